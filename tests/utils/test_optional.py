import pytest

from arl.utils.optional import import_optional


def test_a_present_module_is_returned_and_a_missing_one_says_what_to_install():
    assert import_optional("json", "unused").dumps([1]) == "[1]"
    with pytest.raises(ImportError, match=r"^x needs y: pip install 'arl\[z\]'$") as info:
        import_optional("arl_no_such_module", "x needs y: pip install 'arl[z]'")
    assert isinstance(info.value.__cause__, ImportError)  # the original error stays chained
