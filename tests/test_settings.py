"""config.pbtxt parameters: typed, validated, and a bad one names itself."""

import pytest

from voxtriton.serving.settings import TTSSettings


def config(**parameters):
    return {"parameters": {key: {"string_value": value} for key, value in parameters.items()}}


def test_parameters_are_typed_and_scheduler_ones_go_to_the_scheduler():
    settings, scheduler = TTSSettings.from_model_config(config(switch_interval_ms="0.5", backbone_partition="shared",
                                                               scheduler_policy="concurrent"))
    assert settings.switch_interval_ms == 0.5 and settings.backbone_partition == "shared"
    assert scheduler.policy == "concurrent"


@pytest.mark.parametrize("name, value, message", [
    ("backbone_partition", "half", "'backbone_partition' must be exclusive or shared"),
    ("switch_interval_ms", "0", "'switch_interval_ms' must be in"),
    ("switch_interval_ms", "fast", "'switch_interval_ms': cannot read 'fast' as float"),
    ("backbone_sms", "100", "unknown parameter(s) backbone_sms"),
])
def test_a_bad_parameter_is_refused_by_name(name, value, message):
    with pytest.raises(ValueError) as error:
        TTSSettings.from_model_config(config(**{name: value}))
    assert message in str(error.value)
