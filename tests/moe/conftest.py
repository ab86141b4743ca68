import pytest

from tests.moe.ranks import Ranks


@pytest.fixture(scope="session")
def ranks():
    """``ranks(world)``: the session's gloo ranks of that size, started on first use (see ``ranks.py``)."""
    started: dict[int, Ranks] = {}

    def get(world: int) -> Ranks:
        if world not in started or started[world].broken:
            started[world] = Ranks(world)
        return started[world]

    yield get
    for group in started.values():
        group.close()
