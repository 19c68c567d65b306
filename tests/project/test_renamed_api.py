"""Public names renamed so that no two mean different things: the old `flatcli.api` names,
deprecated for one release, are gone; the DataFrame forms at the top keep their names."""

from __future__ import annotations

import warnings

import pytest

import flatcli
from flatcli import api

RENAMED = {
    "collect": "collect_report",
    "correlate": "correlate_report",
    "plan_costs": "estimate_costs",
    "CostPlan": "CostEstimate",
}


@pytest.mark.parametrize(("old", "new"), sorted(RENAMED.items()))
def test_an_old_name_is_gone_and_the_new_one_is_public(old, new):
    with pytest.raises(AttributeError, match=old):
        getattr(api, old)
    assert old not in api.__all__ and new in api.__all__


def test_the_new_names_and_the_top_level_forms_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for new in RENAMED.values():
            getattr(api, new)
        # the DataFrame forms users call keep their names and differ from the reports'
        assert flatcli.correlate is api.correlate_frame is not api.correlate_report
        assert flatcli.collect is api.collect_frame is not api.collect_report


def test_an_unknown_name_is_still_an_attribute_error():
    with pytest.raises(AttributeError, match="nosuch"):
        api.nosuch  # noqa: B018
