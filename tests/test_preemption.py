"""Preemption and requeue, launched as a scheduler launches a job: ``python preemption_job.py`` in a
process session of its own (Lightning's launcher starting rank 1 in it), or one process per rank
with SLURM's variables. A signal lands at a random training step (or inside a checkpoint save);
every rank must exit non-zero within 30 s naming the rank and the signal, leave no process behind,
and the last checkpoint must resume equal to an uninterrupted run. The SLURM case: the requeue
signal saves ``hpc_ckpt_1.ckpt`` on every rank and calls ``scontrol requeue`` (a stub on ``PATH``
that records its call); the requeued job resumes from it by itself, equal to an uninterrupted run.

The default run has one launch per case; ``pytest -m soak tests/test_preemption.py`` repeats each
case 10 times and records every outcome (``PREEMPTION_RECORD``: a JSON file to write them to)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import preemption_job as job
from distributed import free_port, run_distributed

JOB = Path(job.__file__).resolve()
ROOT = JOB.parents[1]
BOUND = 30.0  # seconds from the signal until no process of the job is left (the soak's measure)
HANG = 90.0  # the default run's: a hang detector on a shared machine, not a timing measure
ORIGIN = {0: "rank 0 (pp=0, dp=0, ep=0)", 1: "rank 1 (pp=1, dp=0, ep=0)"}
# case: (rank whose process gets the signal, the signal, the rank the messages must name)
CASES = {
    "term_rank1": ("rank1", signal.SIGTERM, 1),
    "term_launcher": ("launcher", signal.SIGTERM, 0),  # Lightning's launcher passes it on: rank 0 is named
    "int_all": ("session", signal.SIGINT, 0),  # Ctrl+C: every process of the session
    "in_save": ("rank1", signal.SIGTERM, 1),  # rank 1 is inside the checkpoint save of step 10
}


def session_processes(sid: int) -> list[int]:
    """Pids of the processes in session ``sid`` (from /proc)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[3]) == sid and fields[0] != "Z":  # fields[3]: the session id; Z: a zombie awaiting its parent
            pids.append(int(entry))
    return pids


def _env(out: Path, extra: dict | None = None) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(JOB.parent), os.environ.get("PYTHONPATH", "")]))
    env.update(extra or {})
    return env


def _slurm_env(out: Path) -> dict:
    (out / "bin").mkdir(exist_ok=True)
    scontrol = out / "bin" / "scontrol"
    scontrol.write_text(f"#!/bin/sh\necho \"$@\" >> {out / 'scontrol.txt'}\n")
    scontrol.chmod(0o755)
    return _env(out, dict(PATH=f"{out / 'bin'}{os.pathsep}{os.environ['PATH']}", SLURM_NTASKS="2",
                          SLURM_NTASKS_PER_NODE="2", SLURM_NNODES="1", SLURM_NODEID="0", SLURM_JOB_ID="4242",
                          SLURM_JOB_NAME="train", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())))


def launch(out: Path, case: str) -> subprocess.Popen:
    """The job in a new session: ``python preemption_job.py`` (Lightning's launcher starts rank 1),
    or for ``slurm`` a shell starting one process per rank, as ``srun`` does."""
    if case == "slurm":
        script = ('SLURM_PROCID=0 SLURM_LOCALID=0 "$0" "$1" "$2" "$3" & p0=$!; '
                  'SLURM_PROCID=1 SLURM_LOCALID=1 "$0" "$1" "$2" "$3" & p1=$!; '
                  'wait $p0; c0=$?; wait $p1; c1=$?; exit $((c0 | c1))')
        cmd, env = ["sh", "-c", script, sys.executable, str(JOB), str(out), case], _slurm_env(out)
    else:
        cmd, env = [sys.executable, str(JOB), str(out), case], _env(out)
    log = open(out / "log.txt", "a")
    return subprocess.Popen(cmd, cwd=out, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _progress(out: Path, rank: int):
    try:
        return json.loads((out / f"rank{rank}.json").read_text())
    except (OSError, ValueError):
        return None


def wait_for_step(proc: subprocess.Popen, out: Path, step: int, timeout: float = 300.0) -> dict:
    """Both ranks' progress once both have reached ``step``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen = {rank: _progress(out, rank) for rank in (0, 1)}
        if all(p is not None and p["step"] >= step for p in seen.values()):
            return seen
        if proc.poll() is not None:
            raise AssertionError(f"the job exited ({proc.returncode}) before step {step}:\n{_log(out)}")
        time.sleep(0.01)
    raise AssertionError(f"the job did not reach step {step} in {timeout}s:\n{_log(out)}")


def _log(out: Path) -> str:
    return (out / "log.txt").read_text(errors="replace")[-6000:]


def wait_until_gone(proc: subprocess.Popen, signalled_at: float, bound: float) -> tuple[object, float, list[int]]:
    """(exit status, seconds from the signal until the session was empty, pids left at ``bound``)."""
    sid = proc.pid
    while time.monotonic() - signalled_at < bound:
        proc.poll()
        if proc.returncode is not None and not session_processes(sid):
            return proc.returncode, time.monotonic() - signalled_at, []
        time.sleep(0.05)
    left = session_processes(sid)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    return proc.returncode, time.monotonic() - signalled_at, left


# -- resuming, and the run it must equal (fast: forked ranks, see distributed.py) --------------------

def _reference(rank, world):
    os.environ["LOCAL_RANK"] = str(rank)
    torch.manual_seed(0)
    model = job.Regressor()
    job.trainer_for("/nonexistent", "reference", checkpoints=False).fit(model, job.data())
    return job.parameters(model)


def _resume(rank, world, out):
    os.environ["LOCAL_RANK"] = str(rank)
    torch.manual_seed(1)  # the checkpoint's values must replace these
    model = job.Regressor()
    trainer = job.trainer_for(out, "resume", callbacks=[job.Start(out)])
    trainer.fit(model, job.data(), ckpt_path="last")
    return json.loads((Path(out) / f"start{rank}.json").read_text()), trainer.global_step, job.parameters(model)


@pytest.fixture(scope="module")
def reference():
    return run_distributed(_reference, 2, timeout=600)


def _differences(params: dict, expected: dict) -> list[str]:
    return [name for name, value in expected.items() if not torch.equal(params[name], value)]


# -- one launch of a case, every outcome recorded ------------------------------------------------

def run_case(case: str, out: Path, reference: list, rng: random.Random, bound: float) -> dict:
    """Launch, signal at a random step, check (every process gone within ``bound`` seconds of the
    signal); returns the outcome (``problems`` empty when it holds)."""
    out.mkdir(parents=True)
    target = job.SAVE_STEP if case == "in_save" else rng.randint(6, job.MAX_STEPS - 6)
    outcome: dict = {"case": case, "target_step": target, "bound": bound, "problems": []}
    proc = launch(out, case)
    try:
        if case == "slurm":
            _slurm(proc, out, target, outcome)
        else:
            _signal_and_stop(proc, out, target, case, outcome)
        outcome["load_average"] = os.getloadavg()[0]  # the machine is shared: read the seconds with it
    finally:
        if proc.poll() is None:
            for pid in session_processes(proc.pid):
                os.kill(pid, signal.SIGKILL)
            proc.wait()
    # Resumed whatever the launch's problems (each is recorded), if it left something to resume from.
    try:
        if case == "slurm" and outcome.get("hpc_saved"):
            _requeue(out, reference, outcome)
        elif case != "slurm" and "stopped_before_step" in outcome:
            _resume_from_last(out, reference, outcome)
    except Exception as exc:  # noqa: BLE001 - recorded with the outcome; the next launch goes on
        outcome["problems"].append(f"resuming failed: {type(exc).__name__}: {str(exc)[:3000]}")
    return outcome


def _signal_and_stop(proc, out: Path, target: int, case: str, outcome: dict) -> None:
    problems = outcome["problems"]
    where, signum, named = CASES[case]
    if case == "in_save":
        deadline = time.monotonic() + 300
        while not (out / "saving").exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"rank 1 never reached the save of step {job.SAVE_STEP}:\n{_log(out)}")
            time.sleep(0.01)
        seen = {1: {"pid": int((out / "saving").read_text())}}
    else:
        seen = wait_for_step(proc, out, target)
    pid = {"rank1": seen[1]["pid"] if where == "rank1" else None, "launcher": proc.pid}.get(where)
    if where == "session":
        os.killpg(proc.pid, signum)
    else:
        os.kill(pid, signum)
    signalled_at = time.monotonic()
    outcome["signalled_at_step"] = (_progress(out, 1) or {}).get("step")
    rc, seconds, left = wait_until_gone(proc, signalled_at, outcome["bound"])
    outcome.update(exit_status=rc, seconds=round(seconds, 1), left=left)
    log = _log(out)
    if rc == 0:
        problems.append("exit status 0")
    if left:
        problems.append(f"processes {left} still running {outcome['bound']:g}s after the signal")
    origin = f"{ORIGIN[named]} received {signum.name}: every rank stopped before training step "
    if origin not in log:
        problems.append(f"no message naming {ORIGIN[named]} and {signum.name}")
    else:
        outcome["stopped_before_step"] = int(log.split(origin, 1)[1].split()[0])
    for rank in (0, 1):
        if f"-> {ORIGIN[rank]} stopped" not in log:
            problems.append(f"rank {rank} did not report the stop")
    if problems:
        outcome["log"] = log


def _resume_from_last(out: Path, reference: list, outcome: dict) -> None:
    from lightning_pp.strategies.checkpoint import is_sharded_checkpoint

    problems = outcome["problems"]
    last = out / "checkpoints" / "last.ckpt"
    if not is_sharded_checkpoint(last):
        problems.append(f"{last} is not a complete checkpoint")
        return
    stopped = outcome["stopped_before_step"]
    results = run_distributed(_resume, 2, str(out), timeout=600)
    for rank, (start, end, params) in enumerate(results):
        outcome[f"resumed_from_step_rank{rank}"] = start
        if start != job.EVERY * (stopped // job.EVERY):
            problems.append(f"rank {rank} resumed from step {start}, not from the last checkpoint before step "
                            f"{stopped}")
        if end != job.MAX_STEPS:
            problems.append(f"rank {rank} ended at step {end}")
        differing = _differences(params, reference[rank])
        if differing:
            problems.append(f"rank {rank}: resumed parameters differ from the uninterrupted run's: {differing}")


def _slurm(proc, out: Path, target: int, outcome: dict) -> None:
    problems = outcome["problems"]
    seen = wait_for_step(proc, out, target)
    for rank in (0, 1):  # srun passes the scheduler's requeue signal to every task
        os.kill(seen[rank]["pid"], signal.SIGUSR1)
    deadline = time.monotonic() + outcome["bound"]
    while not (out / "scontrol.txt").exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    outcome["scontrol"] = (out / "scontrol.txt").read_text().strip() if (out / "scontrol.txt").exists() else None
    if outcome["scontrol"] != "requeue 4242":
        problems.append(f"scontrol was called as {outcome['scontrol']!r}, not 'requeue 4242'")
    for rank in (0, 1):  # then the scheduler ends the job
        try:
            os.kill(seen[rank]["pid"], signal.SIGTERM)
        except ProcessLookupError:
            pass
    rc, seconds, left = wait_until_gone(proc, time.monotonic(), outcome["bound"])
    outcome.update(exit_status=rc, seconds=round(seconds, 1), left=left)
    if rc == 0:
        problems.append("exit status 0")
    if left:
        problems.append(f"processes {left} still running {outcome['bound']:g}s after SIGTERM")
    hpc = out / "hpc_ckpt_1.ckpt"
    from lightning_pp.strategies.checkpoint import is_sharded_checkpoint

    outcome["hpc_saved"] = is_sharded_checkpoint(hpc)
    if not outcome["hpc_saved"] or (out / "hpc_ckpt_2.ckpt").exists():
        problems.append(f"{hpc} is not the one complete requeue checkpoint: {sorted(os.listdir(out))}")
    if problems:
        outcome["log"] = _log(out)


def _requeue(out: Path, reference: list, outcome: dict) -> None:
    problems = outcome["problems"]
    for rank in (0, 1):
        (out / f"rank{rank}.json").unlink(missing_ok=True)
    saved_at = torch.load(out / "hpc_ckpt_1.ckpt" / "meta.pt", weights_only=False)["global_step"]
    proc = launch(out, "slurm")  # the requeued job: same directory and variables, fresh processes
    try:
        rc = proc.wait(timeout=400)
    finally:
        if proc.poll() is None:
            for pid in session_processes(proc.pid):
                os.kill(pid, signal.SIGKILL)
            proc.wait()
    if rc != 0:
        problems.append(f"the requeued job exited with {rc}")
        outcome["log"] = _log(out)
        return
    for rank in (0, 1):
        start = json.loads((out / f"start{rank}.json").read_text())
        outcome[f"resumed_from_step_rank{rank}"] = start
        if start != saved_at:
            problems.append(f"rank {rank} resumed from step {start}, not from hpc_ckpt_1.ckpt (step {saved_at})")
        differing = _differences(torch.load(out / f"params{rank}.pt"), reference[rank])
        if differing:
            problems.append(f"rank {rank}: requeued parameters differ from the uninterrupted run's: {differing}")


def _assert_all_held(outcomes: list[dict]) -> None:
    failed = [o for o in outcomes if o["problems"]]
    summary = [{k: v for k, v in o.items() if k != "log"} for o in outcomes]
    assert not failed, json.dumps(summary, indent=1) + "\n\n" + "\n\n".join(o.get("log", "") for o in failed)


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("case", [*CASES, "slurm"])
def test_signal_stops_every_rank_and_the_job_resumes_exactly(tmp_path, case, reference):
    _assert_all_held([run_case(case, tmp_path / "run", reference, random.Random(), HANG)])


@pytest.mark.soak
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("case", [*CASES, "slurm"])
def test_signal_soak_10_launches(tmp_path, case, reference):
    rng, outcomes = random.Random(), []
    record = os.environ.get("PREEMPTION_RECORD")
    for i in range(10):
        outcomes.append(run_case(case, tmp_path / f"run{i}", reference, rng, BOUND))
        if record:  # as each launch ends, so an interrupted soak keeps what it saw
            with open(record, "a") as f:
                f.write(json.dumps({k: v for k, v in outcomes[-1].items() if k != "log"}) + "\n")
    _assert_all_held(outcomes)


# -- a fit that fails on every rank alike, then a fresh fit in the same processes (a sweep's next trial) --

class _RaisesOnEveryRank(job.Regressor):
    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.trainer.global_step == 3:
            raise ValueError("trial rejected by the user's hook")


class _NonFinite(job.Regressor):
    def pipeline_loss(self, output, batch):
        loss = super().pipeline_loss(output, batch)
        return loss * float("nan") if self.trainer.global_step == 2 else loss


def _failed_trials_then_a_fresh_fit(rank, world):
    from lightning_pp.runtime.failure.errors import NonFiniteError

    os.environ["LOCAL_RANK"] = str(rank)
    seen = []
    trials = ((_RaisesOnEveryRank, {}, ValueError), (_NonFinite, {}, NonFiniteError),
              (job.Regressor, {"layout": [2, 2]}, ValueError))  # 4 layers for a model of 6: refused at setup
    for model_class, strategy, expected in trials:
        torch.manual_seed(0)
        try:
            job.trainer_for("/nonexistent", "trial", checkpoints=False, **strategy).fit(model_class(), job.data())
        except expected as exc:
            seen.append(f"{type(exc).__name__}: {exc}".splitlines()[0])
    torch.manual_seed(0)
    model = job.Regressor()
    job.trainer_for("/nonexistent", "trial", checkpoints=False).fit(model, job.data())
    return seen, job.parameters(model)


@pytest.mark.timeout(1800)
def test_failed_fits_on_every_rank_then_a_fresh_fit_in_the_same_processes_equals_that_fit_alone(reference):
    for rank, (seen, params) in enumerate(run_distributed(_failed_trials_then_a_fresh_fit, 2, timeout=600)):
        assert len(seen) == 3, seen  # each trial failed on this rank with its own error
        assert "trial rejected by the user's hook" in seen[0] and seen[1].startswith("NonFiniteError"), seen
        assert "layout=[2, 2] sums to 4 layers" in seen[2], seen
        assert not _differences(params, reference[rank]), f"rank {rank}: the fresh fit differs from that fit alone"
