"""How a request that did not end by stop or length is counted (``finished_reason``)."""

from __future__ import annotations

import asyncio

import pytest

from engine.core_protocol import EngineDeadError, RequestTimeoutError, StreamBacklogError
from server.generation import EngineAbortedError, ending_of


@pytest.mark.parametrize(
    "error, ending",
    [
        (StreamBacklogError("behind"), "client_too_slow"),
        (RequestTimeoutError("late"), "timeout"),
        (asyncio.CancelledError(), "abort"),
        (GeneratorExit(), "abort"),
        (EngineDeadError("dead"), "error"),
        (EngineAbortedError("aborted"), "error"),
        (ValueError("refused"), "error"),
    ],
)
def test_each_way_a_request_stops_has_its_name(error, ending):
    assert ending_of(error) == ending
