"""GPU-only checks of the Triton backend that the interpreter cannot make: CUDA-graph capture (no host
sync on the hot path) and int64 offsets past 2**31 elements. Skipped without CUDA."""
import pytest
import torch

import flowrl

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _schedule(steps=10, shift=3.0):
    t = torch.linspace(1, 0, steps + 1, dtype=torch.float64)
    return (shift * t / (1 + (shift - 1) * t)).to(torch.float32).cuda()


@pytest.mark.parametrize("per_sample_steps", [False, True])
def test_rollout_and_recompute_replay_in_a_cuda_graph(per_sample_steps):
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (3, 64, 40)
    x = torch.randn(shape, device="cuda", generator=g).bfloat16()
    v = torch.randn(shape, device="cuda", generator=g).bfloat16()
    noise = torch.randn(shape, device="cuda", generator=g)
    sigmas = _schedule()
    step = torch.tensor([0, 4, 9], device="cuda") if per_sample_steps else 4

    def run():
        out = flowrl.sde_step(x, v, sigmas, step, noise=noise, backend="triton", return_prev_sample_mean=False)
        lp = flowrl.step_log_prob(x, v, out.prev_sample, sigmas, step, backend="triton")
        return out.prev_sample, out.log_prob, lp

    eager = run()  # also validates the schedule once, outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # warm-up on the side stream compiles nothing new
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager, captured):
        assert torch.equal(a, b)
    assert torch.equal(captured[1], captured[2])  # rollout log-prob == recompute, bit for bit


@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.get_device_properties(0).total_memory < 40 * 2**30,
    reason="needs a GPU with 40 GiB",
)
def test_offsets_past_two_to_the_31_elements():
    # two samples of 2**30 + 1000 elements: the second sample's offsets exceed 2**31. A row's log-prob
    # does not depend on its batch, so row 1 computed alone (small offsets) must match bit for bit.
    n = 2**30 + 1000
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn((2, n), device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn((2, n), device="cuda", generator=g, dtype=torch.bfloat16)
    noise = torch.randn((2, n), device="cuda", generator=g)
    sigmas = _schedule()
    both = flowrl.sde_step(x, v, sigmas, 3, noise=noise, backend="triton", return_prev_sample_mean=False)
    alone = flowrl.sde_step(x[1:], v[1:], sigmas, 3, noise=noise[1:], backend="triton", return_prev_sample_mean=False)
    assert torch.equal(both.log_prob[1:], alone.log_prob)
    assert torch.equal(both.prev_sample[1], alone.prev_sample[0])
    del noise
    lp = flowrl.step_log_prob(x, v, both.prev_sample, sigmas, 3, backend="triton")
    assert torch.equal(lp, both.log_prob)


def test_batches_past_the_grid_limit_of_65535_samples():
    # one program per (sample, chunk) on a 1-D grid: 70,000 samples are one launch; every row equals
    # the same row computed alone, and the rollout's log-probs equal the recompute's
    g = torch.Generator(device="cuda").manual_seed(2)
    b, n = 70_000, 1100
    x = torch.randn((b, n), device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn((b, n), device="cuda", generator=g, dtype=torch.bfloat16)
    noise = torch.randn((b, n), device="cuda", generator=g)
    step = torch.randint(0, 10, (b,), device="cuda", generator=g)
    sigmas = _schedule()
    out = flowrl.sde_step(x, v, sigmas, step, noise=noise, backend="triton", return_prev_sample_mean=False)
    lp = flowrl.step_log_prob(x, v, out.prev_sample, sigmas, step, backend="triton")
    assert torch.equal(lp, out.log_prob)
    for row in (0, 65_535, b - 1):
        alone = flowrl.step_log_prob(x[row:row + 1], v[row:row + 1], out.prev_sample[row:row + 1], sigmas,
                                     step[row:row + 1], backend="triton")
        assert torch.equal(alone, lp[row:row + 1])
