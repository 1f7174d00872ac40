"""A codec lane: decodes chunks (codec state in, state out). Logic lives in voxtriton.serving."""

from voxtriton.serving.triton_models import CodecTritonModel


class TritonPythonModel:
    def initialize(self, args):
        self.model = CodecTritonModel(args)

    def execute(self, requests):
        return self.model.execute(requests)

    def finalize(self):
        self.model.finalize()
