"""Pure pieces of the engines' version bookkeeping (the live behaviour is in tests/integration)."""

from __future__ import annotations

import asyncio

import pytest

from factory.rollout.engine import AdmissionGate
from factory.rollout.vllm import VLLMEngine, spans_to_versions


def test_spans_become_per_token_versions():
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    assert spans_to_versions(spans, 5, 0) == [3, 3, 4, 4, 4]


def test_uncovered_tokens_and_unlabelled_spans_get_the_default():
    spans = [{"version": None, "start": 0, "end": 2}, {"version": "7", "start": 3, "end": 9}]
    assert spans_to_versions(spans, 5, 6) == [6, 6, 6, 7, 7]
    assert spans_to_versions(None, 3, 2) == [2, 2, 2]


def test_unknown_partial_rollout_mode_is_refused():
    with pytest.raises(ValueError, match="rollout.partial_rollout: unknown mode 'later'"):
        VLLMEngine("m", partial_rollout="later")


def test_gate_close_keeps_inside_requests_and_reports_idle():
    async def scenario():
        gate = AdmissionGate()
        async with gate:
            gate.close()
            assert not await gate.wait_idle(0.01)  # one request still inside
        assert await gate.wait_idle(0.01)
        entered = asyncio.Event()

        async def late():
            async with gate:
                entered.set()

        task = asyncio.create_task(late())
        await asyncio.sleep(0.02)
        assert not entered.is_set()  # closed: new requests wait
        gate.open()
        await asyncio.wait_for(task, 1)
        assert entered.is_set()

    asyncio.run(scenario())
