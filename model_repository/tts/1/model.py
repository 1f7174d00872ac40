"""`tts`: the decoupled scheduler model. Logic lives in voxtriton.serving (tested without a server)."""

from voxtriton.serving.triton_models import TTSTritonModel


class TritonPythonModel:
    def initialize(self, args):
        self.model = TTSTritonModel(args)

    def execute(self, requests):
        return self.model.execute(requests)

    def finalize(self):
        self.model.finalize()
