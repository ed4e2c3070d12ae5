from __future__ import annotations

from collections.abc import Iterator

import pytest

from mindie import _C


@pytest.fixture(params=_C.available_isas())
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs a test once per kernel variant this build has and this CPU runs."""
    previous = _C.get_isa()
    _C.set_isa(request.param)
    yield request.param
    _C.set_isa(previous)
