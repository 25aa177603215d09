"""The decode thread's CPU threads follow what other programs leave free (engine.cpu_share)."""
import pytest
import torch

from moedesk.engine.cpu_share import CpuShare, cpu_seconds, threads_for
from moedesk.engine.requests import Request, SamplingParams


def test_threads_leave_the_cores_other_programs_keep_busy():
    assert threads_for(most=8, cores=8, others_busy=0.0) == 8
    assert threads_for(most=8, cores=8, others_busy=0.4) == 8  # a background flicker takes no core
    assert threads_for(most=8, cores=8, others_busy=0.6) == 7  # most of a core does
    assert threads_for(most=8, cores=8, others_busy=2.2) == 6
    assert threads_for(most=7, cores=8, others_busy=1.0) == 7  # the core the engine left free takes the program
    assert threads_for(most=2, cores=2, others_busy=5.0) == 1  # never fewer than one


class Machine:
    """A fake clock and CPU counters: `run(seconds, others, own)` advances them as a machine busy so would."""

    def __init__(self):
        self.now, self.busy, self.own = 100.0, 5000.0, 10.0
        self.others = 0.0  # what other programs keep busy while the share sleeps

    def run(self, seconds, others, own):
        self.now += seconds
        self.others = others
        self.busy += (others + own) * seconds
        self.own += own * seconds

    def sample(self):
        return self.busy, self.own


def share_on(machine, set_threads, monkeypatch, most=4, cores=4, logical_cpus=4):
    monkeypatch.setenv("MOEDESK_FOLLOW_CPU", "1")
    monkeypatch.setattr("psutil.cpu_count", lambda logical=True: logical_cpus if logical else cores)
    return CpuShare(set_threads, lambda: most, cores=cores, clock=lambda: machine.now, sample=machine.sample,
                    sleep=lambda seconds: machine.run(seconds, others=machine.others, own=0.0))


def test_the_share_follows_another_program_and_gives_its_cores_back(monkeypatch):
    machine, set_to = Machine(), []
    share = share_on(machine, set_to.append, monkeypatch)  # the count starts with the engine
    machine.run(0.04, others=2.0, own=2.0)
    share.follow()  # the first step waits out the first measure's tenth of a second
    assert machine.now == pytest.approx(100.1)
    assert share.others_busy == pytest.approx(2.0, abs=0.01) and set_to == [2]
    machine.run(0.5, others=0.0, own=4.0)
    share.follow()  # within the interval after that: nothing measured
    assert set_to == [2] and share.others_busy == pytest.approx(2.0, abs=0.01)
    machine.run(0.5, others=4.0, own=0.0)
    share.follow()
    assert share.others_busy == pytest.approx(2.0, abs=0.01) and set_to == [2]  # over the whole second
    machine.run(1.0, others=2.0, own=2.0)
    share.follow()
    assert set_to == [2]  # told once
    machine.run(1.0, others=0.0, own=4.0)  # its own busy cores are not another program's
    share.follow()
    assert set_to == [2, 4] and share.threads == 4


def test_a_first_reply_on_a_busy_machine_starts_with_the_share(monkeypatch):
    machine, set_to = Machine(), []
    share = share_on(machine, set_to.append, monkeypatch)
    machine.run(3.0, others=3.0, own=1.0)  # the load, the app's start, a user typing; another program busy
    share.follow()  # the first reply's first step
    assert set_to == [1]


def test_logical_cpus_count_as_their_share_of_a_core(monkeypatch):
    machine, set_to = Machine(), []
    share = share_on(machine, set_to.append, monkeypatch, logical_cpus=8)
    machine.run(1.0, others=2.0, own=4.0)  # two hyperthreads busy: one core's worth
    share.follow()
    assert share.others_busy == pytest.approx(1.0) and set_to == [3]


def test_the_knob_keeps_the_engines_count(monkeypatch):
    machine, set_to = Machine(), []
    monkeypatch.setenv("MOEDESK_FOLLOW_CPU", "0")
    share = CpuShare(set_to.append, lambda: 4, cores=4, clock=lambda: machine.now, sample=machine.sample)
    for _ in range(3):
        machine.run(1.0, others=4.0, own=0.0)
        share.follow()
    assert set_to == []


def test_the_machines_counters_move_forward():
    busy, own = cpu_seconds()
    sum(i * i for i in range(300_000))  # a little work of this process's own
    busy2, own2 = cpu_seconds()
    assert busy2 >= busy and own2 > own >= 0


def test_the_native_engines_decode_thread_takes_the_share(tiny_checkpoint, monkeypatch):
    from moedesk.engine.runtime import Engine

    engine = Engine.load(str(tiny_checkpoint("qwen3_moe")), device="cpu", dtype="float32")
    request = Request(list(range(3, 12)), SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True))
    alone = next(engine.generate([request]))
    share = engine.scheduler.cpu_share
    assert share.set_threads is torch.set_num_threads and share.fixed  # the tests keep the load's count
    before = torch.get_num_threads()
    machine, seen = Machine(), []

    def set_threads(n):
        seen.append(n)
        torch.set_num_threads(n)

    share.fixed, share.set_threads, share.interval_s = False, set_threads, 0.0
    share.cores, share.per_cpu, share.clock, share.sample = 4, 1.0, lambda: machine.now, machine.sample
    share._most, share.most = (lambda: 4), None
    share.start()  # as at the engine's start
    machine.run(1.0, others=3.0, own=1.0)  # before the request, three cores busy elsewhere
    try:
        followed = next(engine.generate([request]))
    finally:
        torch.set_num_threads(before)
    assert seen == [1]  # three cores busy elsewhere: one thread, from the first step on
    assert followed.token_ids == alone.token_ids

