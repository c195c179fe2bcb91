"""The failure texts the stand-in prints, shaped like SGLang's.

A scheduler that raises logs `Scheduler hit an exception: <traceback>` under its TP prefix
and sends SIGQUIT to the main process, which logs `Received sigquit from a child process. It
usually means the child failed.` and kills its tree (sglang/srt/managers/scheduler.py,
run_scheduler_process; sglang/srt/entrypoints/engine.py, sigquit_handler). Frames other than
the ones named in the incident are illustrative: file names are SGLang's, line numbers are not.
"""

_SRT = "/opt/sglang/python/sglang/srt"

# While launching (sglang/srt/entrypoints/engine.py:1976, launch_phase_sigquit_handler).
SIGQUIT_FROM_CHILD = "Received sigquit from a child process. It usually means the child failed."
# Once running (sglang/srt/managers/tokenizer_manager.py:4072, running_phase_sigquit_handler),
# then dump_requests_before_crash (tokenizer_manager.py:3480-3502) and kill_process_tree.
SIGQUIT_RUNNING = "SIGQUIT received. signum=None, frame=None. It usually means one child failed."
CRASH_DIAGNOSTICS = "Sleeping 5 seconds before crash diagnostics to let GPU activity settle."
NO_LIVE_SCHEDULERS = "No live scheduler processes found; skipping py-spy and CUDA coredump."


def subprocess_crashed(name: str, pid: int, exitcode: int) -> str:
    """sglang/srt/utils/watchdog.py:217, SubprocessWatchdog._check_processes."""
    return (
        f"Subprocess {name} (pid={pid}) crashed with exit code {exitcode}. "
        "Triggering SIGQUIT for cleanup..."
    )


def kill_process_tree(pid: int) -> str:
    """sglang/srt/utils/common.py, kill_process_tree's first log line."""
    return f"kill_process_tree called: parent_pid={pid}, include_parent=True, pid={pid}"


# The seed incident (docs/standin.md): the EAGLE v2 worker's constructor had failed part-way,
# so the first real decode reached line 702 of eagle_worker_v2.py without the attribute.
SEED_INCIDENT = f"""Scheduler hit an exception: Traceback (most recent call last):
  File "{_SRT}/managers/scheduler.py", line 3075, in run_scheduler_process
    scheduler.event_loop_overlap()
  File "/opt/sglang/venv/lib/python3.12/site-packages/torch/utils/_contextlib.py", line 120, \
in decorate_context
    return func(*args, **kwargs)
           ^^^^^^^^^^^^^^^^^^^^^
  File "{_SRT}/managers/scheduler.py", line 1107, in event_loop_overlap
    batch_result = self.run_batch(batch)
                   ^^^^^^^^^^^^^^^^^^^^^
  File "{_SRT}/managers/scheduler.py", line 2262, in run_batch
    batch_result = self.model_worker.forward_batch_generation(model_worker_batch)
                   ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "{_SRT}/speculative/eagle_worker_v2.py", line 702, in forward_batch_generation
    if bs > self.spec_disable_batch_threshold > 0:
            ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
AttributeError: 'EAGLEWorkerV2' object has no attribute 'spec_disable_batch_threshold'"""

# A load that dies capturing CUDA graphs; the "Possible solutions" text is SGLang's own
# (sglang/srt/model_executor/cuda_graph_runner.py).
LOAD_CRASH = f"""Scheduler hit an exception: Traceback (most recent call last):
  File "{_SRT}/managers/scheduler.py", line 3070, in run_scheduler_process
    scheduler = Scheduler(
                ^^^^^^^^^^
  File "{_SRT}/managers/scheduler.py", line 385, in __init__
    self.tp_worker = TpModelWorker(
                     ^^^^^^^^^^^^^^
  File "{_SRT}/model_executor/model_runner.py", line 552, in initialize
    self.init_device_graphs()
  File "{_SRT}/model_executor/cuda_graph_runner.py", line 384, in __init__
    raise Exception(
Exception: Capture cuda graph failed: CUDA out of memory. Tried to allocate 2.00 GiB. \
GPU 0 has a total capacity of 139.81 GiB of which 1.07 GiB is free.
Possible solutions:
1. set --mem-fraction-static to a smaller value (e.g., 0.8 or 0.7)
2. set --cuda-graph-max-bs to a smaller value (e.g., 16)
3. disable torch compile by not using --enable-torch-compile
4. disable CUDA graph by --disable-cuda-graph. (Not recommended. Huge performance loss)
Open an issue on GitHub https://github.com/sgl-project/sglang/issues/new/choose """
