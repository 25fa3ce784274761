"""The Lua text sent to Redis: layout names written as literals, nothing else touched."""

from __future__ import annotations

import re

import pytest

from celery_fair.keys import layout, scripts

ALL = [v for v in vars(scripts).values() if isinstance(v, scripts.Script)]


@pytest.mark.parametrize("script", ALL, ids=lambda s: s.name)
def test_no_name_is_left_for_the_broker_to_look_up(script: scripts.Script) -> None:
    for line in script.text.splitlines():
        code = line.split("--", 1)[0]
        assert not re.search(r"\bN\.[A-Z]", code), line
    assert not re.search(r"\blocal N\b", script.text)


def test_a_name_becomes_its_value() -> None:
    text = scripts.source("prelude.lua")
    assert f"kname(lb, {layout.ACTIVE!r})".replace("'", '"') in text
    assert "N.ACTIVE" not in text.split("local function kname", 1)[1]


def test_an_unknown_name_outside_a_comment_is_refused() -> None:
    assert scripts._with_literals("-- N.OLD_* names\n") == "-- N.OLD_* names\n"
    with pytest.raises(ValueError, match="'NOPE'"):
        scripts._with_literals("local x = N.NOPE\n")
