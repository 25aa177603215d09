"""A decode step handed between the GPU and the host through flags (kernels.host_handoff): the host's side of the
flags, and the executor's part (`host_only`, `host_share`). Here a thread plays the GPU's side;
tests/model/test_gpu_equivalence.py runs whole handed-over steps inside CUDA graphs."""
import functools
import threading
import time

import pytest
import torch

from moedesk.engine.offload.expert_executor import HostRouting
from moedesk.engine.offload.offload_executor import OffloadExecutor
from moedesk.kernels import host_handoff
from moedesk.kernels.expert_weights import ExpertWeights

pytestmark = pytest.mark.skipif(host_handoff.native() is None, reason=f"no C compiler: {host_handoff.why_not()}")


def test_the_host_waits_for_each_layers_flag_and_answers_on_its_own():
    handoff = host_handoff.Handoff(3, torch.device("cpu"))
    handoff.next_step()
    step = handoff.step
    assert step != 0 and int(handoff.step_host[0]) == step

    def gpu():
        for j in range(3):
            time.sleep(0.02)
            handoff.flags[0, j] = step

    thread = threading.Thread(target=gpu)
    thread.start()
    for j in range(3):
        handoff.ready(j).synchronize()
        assert int(handoff.flags[0, j]) == step  # not before the GPU's side wrote it
        assert int(handoff.flags[1, j]) != step
        handoff.host_done(j)
        assert int(handoff.flags[1, j]) == step
    thread.join()


def test_a_flag_that_never_comes_raises_and_release_lets_the_gpu_go_on():
    handoff = host_handoff.Handoff(4, torch.device("cpu"))
    handoff.next_step()
    handoff.flags[0, 0] = handoff.step - 1  # last step's routing: not this one
    started = time.perf_counter()
    with pytest.raises(host_handoff.HandoffTimeout, match="layer 0"):
        handoff.host_wait(0, timeout_s=0.05)
    assert time.perf_counter() - started >= 0.05
    handoff.release()
    assert handoff.flags[1].tolist() == [handoff.step] * 4


def test_step_numbers_wrap_around_without_zero():
    handoff = host_handoff.Handoff(1, torch.device("cpu"))
    handoff.step = 0x7FFFFFFF - 1
    handoff.next_step()
    assert handoff.step == 0x7FFFFFFF and int(handoff.step_host[0]) == 0x7FFFFFFF
    handoff.next_step()
    assert handoff.step == 1  # 0 is what the flags hold before any step


def test_signal_checks_what_it_copies_before_launching():
    handoff = host_handoff.Handoff(2, torch.device("cpu"))
    with pytest.raises(ValueError, match="device tensor"):
        handoff.signal(0, (torch.zeros(4), torch.zeros(4)))  # a CPU source
    with pytest.raises(ValueError, match="4-byte words"):
        handoff.signal(0, (torch.zeros(3, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.bfloat16)))
    with pytest.raises(ValueError, match="at most two"):
        handoff.signal(0, *[(torch.zeros(2), torch.zeros(2))] * 3)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 16])
def test_signal_copies_the_routing_before_the_flag(tokens):
    """The kernel that hands a layer to the host: the routing in pinned memory, then the ready flag; in a loop of
    steps so that a flag seen before its routing landed would show as a mismatch."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    handoff = host_handoff.Handoff(2, torch.device("cuda"))
    x_host = torch.zeros(tokens, 4096, dtype=torch.bfloat16, pin_memory=True)
    ids_host = torch.zeros(tokens, 8, dtype=torch.long, pin_memory=True)
    for step in range(20):
        x = torch.randn(tokens, 4096, device="cuda").to(torch.bfloat16)
        ids = torch.randint(0, 128, (tokens, 8), device="cuda")
        handoff.next_step()
        handoff.start()
        handoff.signal(1, (x, x_host), (ids, ids_host))
        handoff.host_wait(1, timeout_s=10)
        seen_x, seen_ids = x_host.clone(), ids_host.clone()  # as the host reads them, before any synchronisation
        assert torch.equal(seen_x, x.cpu()) and torch.equal(seen_ids, ids.cpu()), step
        assert int(handoff.flags[0, 0]) != handoff.step  # the other layer's flag untouched
        handoff.signal(0)  # nothing to copy: the flag alone
        handoff.host_wait(0, timeout_s=10)
        torch.cuda.synchronize()


def _executor(decide=None):
    g = torch.Generator().manual_seed(3)
    bank = ExpertWeights(torch.randn(6, 2 * 96, 64, generator=g) / 8, torch.randn(6, 64, 96, generator=g) / 10, 64, 96)
    decide = decide or (lambda loads: (sorted(loads), []))
    return OffloadExecutor({0: bank}, [[False] * 6], "cpu", decide)


class _Flag:
    waited = 0

    def synchronize(self):
        self.waited += 1


@pytest.mark.parametrize("zero_copy, cpu_width", [(0, 0), (1, 0), (0, 64)])
def test_host_share_is_what_expert_outputs_computes_for_the_host(zero_copy, cpu_width):
    moe = type("Moe", (), {"layer": 0})()
    x, ids = torch.randn(1, 64, generator=torch.Generator().manual_seed(1)), torch.tensor([[4, 1, 5]])
    expected = _executor().expert_outputs(moe, x, ids, out=torch.zeros(3, 64),
                                          host=HostRouting(x, ids, None, cpu_width=cpu_width))
    executor, flag, out = _executor(), _Flag(), torch.full((3, 64), float("nan"))
    executor.host_share(moe, HostRouting(x, ids, flag, zero_copy=zero_copy, cpu_width=cpu_width), out)
    assert flag.waited == 1
    on_cpu = 3 - zero_copy
    torch.testing.assert_close(out[:on_cpu], expected[:on_cpu], rtol=0, atol=0)
    assert out[on_cpu:].isnan().all()  # the GPU's rows are left alone
    s = executor.stats
    assert (s.cpu_experts, s.zero_copy_experts, s.selections) == (on_cpu, zero_copy, 3)
    assert s.split_experts == (on_cpu if cpu_width else 0)
    assert executor.selections[0].tolist() == [0, 1, 0, 0, 1, 1]


def _packed_executor():
    from moedesk.kernels.cpu_quant import available
    from moedesk.kernels.quant_formats import quantize

    if not available():
        pytest.skip("no native packed kernel here")
    g = torch.Generator().manual_seed(5)
    bank = ExpertWeights(quantize(torch.randn(6, 2 * 96, 64, generator=g) / 8, "q8_0"),
                         quantize(torch.randn(6, 64, 96, generator=g) / 10, "q4_0"), 64, 96, "q8_0", "q4_0")
    return OffloadExecutor({0: bank}, [[False] * 6], "cpu", lambda loads: (sorted(loads), []))


@pytest.mark.parametrize("zero_copy, cpu_width, resident", [(0, 0, False), (1, 0, False), (0, 64, False),
                                                           (0, 0, True)])
def test_a_host_plan_is_host_share_prepared_once(zero_copy, cpu_width, resident):
    """The host's side of a captured step, prepared at capture: each call reads the routing buffers as they are
    then (the graph rewrites them every layer) and computes and counts what host_share does."""
    moe = type("Moe", (), {"layer": 0})()
    x, ids = torch.zeros(1, 64), torch.zeros(1, 3, dtype=torch.long)
    planned, shared = _packed_executor(), _packed_executor()
    for executor in (planned, shared):
        executor.simulated = False
        if resident:
            executor.set_placement([[e == 4 for e in range(6)]])
    plan_out, share_out = torch.full((3, 64), float("nan")), torch.full((3, 64), float("nan"))
    flag = _Flag()
    plan = planned.host_plan(moe, HostRouting(x, ids, flag, zero_copy=zero_copy, cpu_width=cpu_width), plan_out)
    assert not isinstance(plan, functools.partial)  # prepared, not host_share again
    g = torch.Generator().manual_seed(2)
    for step in range(3):
        x.copy_(torch.randn(1, 64, generator=g))
        ids.copy_(torch.randperm(6, generator=g)[:3].sort().values)
        plan()
        assert flag.waited == step + 1
        shared.host_share(moe, HostRouting(x.clone(), ids.clone(), _Flag(), zero_copy=zero_copy, cpu_width=cpu_width),
                          share_out)
        on_cpu = 3 - zero_copy
        rows = [r for r in range(on_cpu) if not (resident and int(ids[0, r]) == 4)]  # the GPU's are left alone
        assert torch.equal(plan_out[rows], share_out[rows]) and not plan_out[rows].isnan().any()
    for field in ("cpu_experts", "zero_copy_experts", "split_experts", "gpu_experts", "selections"):
        assert getattr(planned.stats, field) == getattr(shared.stats, field), field
    assert torch.equal(planned.selections[0], shared.selections[0])


def test_a_host_plan_prepared_before_an_expert_cache_swap_computes_the_new_offloaded_experts():
    # The plan points into the offloaded ids (kernels.cpu_quant.prepare_routed): a swap rewrites them in place, so the
    # plan a capture prepared stays valid, as the graph does (no recapture).
    from moedesk.engine.offload.expert_cache import Swap

    moe = type("Moe", (), {"layer": 0})()
    x, ids = torch.zeros(1, 64), torch.zeros(1, 3, dtype=torch.long)
    planned, shared = _packed_executor(), _packed_executor()
    planned.set_placement([[e == 4 for e in range(6)]])
    shared.set_placement([[e == 1 for e in range(6)]])  # the residency after the swap, placed afresh
    plan_out, share_out = torch.full((3, 64), float("nan")), torch.full((3, 64), float("nan"))
    planned.simulated = shared.simulated = False
    plan = planned.host_plan(moe, HostRouting(x, ids, _Flag()), plan_out)
    assert not isinstance(plan, functools.partial)
    planned.simulated = True  # the swap's copy on the CPU tier
    planned._unapplied = [Swap(0, 4, 1)]
    planned.settle()
    planned.simulated = False
    assert planned.on_gpu() == shared.on_gpu()
    x.copy_(torch.randn(1, 64, generator=torch.Generator().manual_seed(3)))
    ids.copy_(torch.tensor([[1, 3, 4]]))
    plan()
    shared.host_share(moe, HostRouting(x.clone(), ids.clone(), _Flag()), share_out)
    assert torch.equal(plan_out[1:], share_out[1:]) and not plan_out[1:].isnan().any()  # 3 and 4: the host's now
    assert plan_out[0].isnan().all()  # expert 1's row: the GPU's
    assert (planned.stats.cpu_experts, planned.stats.gpu_experts) == (2, 1)


def test_a_host_plan_for_16_bit_experts_is_host_share():
    moe = type("Moe", (), {"layer": 0})()
    plan = _executor().host_plan(moe, HostRouting(torch.zeros(1, 64), torch.zeros(1, 3, dtype=torch.long), _Flag()),
                                 torch.zeros(3, 64))
    assert isinstance(plan, functools.partial) and plan.func.__name__ == "host_share"


def test_only_layers_with_no_host_decision_are_handed_over():
    executor = _executor()
    assert not executor.host_only(0, 1, 2)  # the CPU tier simulates the GPU: nothing to hand over
    executor.simulated = False
    assert executor.host_only(0, 1, 2)
    assert not executor.host_only(0, 2, 2)  # two tokens may share an expert: the rule decides per step
    copying = _executor(lambda loads: (sorted(loads)[1:], sorted(loads)[:1]))
    copying.simulated = False
    assert not copying.host_only(0, 1, 2)
    copies_two = _executor(lambda loads: (sorted(loads), []) if len(loads) < 2 else ([], sorted(loads)))
    copies_two.simulated = False
    assert not copies_two.host_only(0, 1, 2)  # a token with both experts offloaded would copy them
    executor.set_placement([[e == 3 for e in range(6)]])  # resident experts run on the GPU in the graph
    assert executor.host_only(0, 1, 2)
    executor.whole_layers_on_device = False  # ... through a grouped launch, where there is one
    assert not executor.host_only(0, 1, 2)
    executor.set_placement([[True] * 6])  # the layer runs on the device whole: nothing for the host
    assert not executor.host_only(0, 1, 2)


def test_the_placement_is_told_a_partly_resident_layer_is_handed_over_exactly_when_host_only_says_so():
    executor = _executor()
    assert not executor.hands_over_partly_resident(2)  # simulated: no graphs, nothing handed over
    for decide in (None, lambda loads: (sorted(loads)[1:], sorted(loads)[:1])):
        executor = _executor(decide)
        executor.simulated, executor.hands_over = False, True  # as on a GPU with the handoff built
        executor.set_placement([[e == 3 for e in range(6)]])
        assert executor.hands_over_partly_resident(2) == executor.host_only(0, 1, 2) == (decide is None)
        executor.hands_over = False  # layers spread over devices (engine.offload.device_orchestra)
        assert not executor.hands_over_partly_resident(2)


def test_resident_experts_on_the_device_and_offloaded_ones_on_the_host_make_the_layer():
    executor = _executor()
    executor.set_placement([[e in (1, 4) for e in range(6)]])
    moe = type("Moe", (), {"layer": 0})()
    x, ids = torch.randn(1, 64, generator=torch.Generator().manual_seed(2)), torch.tensor([[4, 0, 1, 5]])
    expected = _executor().expert_outputs(moe, x, ids)
    y, mask = executor.device_share(moe, x, ids)
    assert mask.tolist() == [True, False, True, False]
    torch.testing.assert_close(y[mask], expected[mask])
    out = torch.full((4, 64), float("nan"))
    executor.host_share(moe, HostRouting(x, ids, _Flag()), out)
    torch.testing.assert_close(out[~mask], expected[~mask], rtol=0, atol=0)
    assert out[mask].isnan().all()  # the resident experts' rows are the device's
    s = executor.stats
    assert (s.cpu_experts, s.gpu_experts, s.gpu_hits, s.selections) == (2, 2, 2, 4)


def test_the_gpus_side_under_triton_s_interpreter_takes_the_step_and_copies_the_hosts_results():
    pytest.importorskip("triton", reason="Triton ships with CUDA builds of torch; CI installs it for these tests")
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton's interpreter is used only where there is no GPU")
    handoff = host_handoff.Handoff(2, torch.device("cpu"))
    handoff.next_step()
    handoff.next_step()
    handoff.start()
    assert int(handoff.step_device[0]) == handoff.step == 2
    handoff.flags[1, 1] = handoff.step  # the host is done with layer 1 (with the spin bound, an unset flag only waits)
    src = torch.randn(2 * host_handoff.COPY_BLOCK + 37, dtype=torch.bfloat16)  # three programs, the last partial
    dst = torch.zeros_like(src)
    handoff.wait(1, src, dst)
    assert torch.equal(dst, src)
    handoff.wait(1)  # a wait with nothing to copy
    with pytest.raises(ValueError, match="one size"):
        handoff.wait(1, src, dst[1:])
