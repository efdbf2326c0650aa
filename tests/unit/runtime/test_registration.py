import pytest

from quantkit.runtime.registration import Registry


def test_register_and_get():
    registry = Registry("widget")

    @registry.register("gptq")
    def widget():
        return 1

    assert registry.get("gptq") is widget and registry.keys() == ["gptq"]


def test_a_second_registration_is_refused():
    registry = Registry("widget")
    registry.register("a")(len)
    with pytest.raises(ValueError, match="widget a registered twice"):
        registry.register("a")(len)


def test_an_unknown_key_lists_what_is_registered():
    registry = Registry("calibration step")
    registry.register("rtn")(len)
    with pytest.raises(LookupError, match=r"no calibration step registered for awq \(registered: rtn\)"):
        registry.get("awq")
