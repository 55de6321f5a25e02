"""docs/guide.md, "Argument order": one rule for every public op and loss. Positional: the sample-shaped
tensors in data-flow order (the state the model saw, the model's output, the other sample-shaped
tensors), then the schedule; keyword-only: everything else, every per-sample [B] tensor among them."""
import inspect

import pytest
import torch

import flowrl
import flowrl.distributed as fd
from flowrl import losses

STATE = {"sample", "noised_sample"}
OUTPUT = {"model_output"}
OTHER_SAMPLE_SHAPED = {"prev_sample", "ref_model_output", "teacher_model_output", "old_model_output", "noise",
                       "clean_sample"}
SCHEDULE = {"sigmas", "step_index", "sigma"}
PER_SAMPLE = {"old_log_prob", "advantages", "group_index", "rollout_is_weights"}
# public functions of the loss module that are not ops or losses on samples (their own, documented signatures)
UTILITIES = {"check_clip_range", "dpo_pairs", "dpo_noise", "dgpo_noise"}


def _category(name):
    for rank, group in enumerate((STATE, OUTPUT, OTHER_SAMPLE_SHAPED, SCHEDULE)):
        if name in group:
            return rank
    return None


def _public_ops_and_losses():
    found = {f"flowrl.{n}": getattr(flowrl, n) for n in ("sde_step", "step_log_prob", "step_kl")}
    for name in losses.__all__:
        fn = getattr(losses, name)
        if inspect.isfunction(fn) and name not in UTILITIES:
            found[f"flowrl.losses.{name}"] = fn
    for name in ("sde_step", "step_log_prob", "step_kl", *fd.LOSSES):
        found[f"flowrl.distributed.{name}"] = getattr(fd, name)
    return found


OPS = _public_ops_and_losses()


def test_every_loss_of_the_package_is_covered():
    """A new loss in flowrl.losses is checked without editing a list (only utilities are exempt)."""
    assert {"flowrl.losses.grpo_loss", "flowrl.losses.nft_loss", "flowrl.losses.awm_loss", "flowrl.losses.dgpo_loss",
            "flowrl.losses.dpo_loss", "flowrl.losses.teacher_kl_loss", "flowrl.losses.awm_log_prob",
            "flowrl.losses.grpo_guard_loss", "flowrl.losses.flow_dppo_loss"} <= set(OPS)
    assert len(OPS) == 3 + 9 + 3 + len(fd.LOSSES)


@pytest.mark.parametrize("name", sorted(OPS))
def test_positional_arguments_follow_the_rule(name):
    params = inspect.signature(OPS[name]).parameters.values()
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    assert not any(p.kind == p.VAR_POSITIONAL for p in params), name
    ranks = [_category(p) for p in positional]
    assert None not in ranks, f"{name}: positional {positional} holds a name outside the rule's groups"
    assert ranks == sorted(ranks), f"{name}: positional {positional} is not state, output, samples, schedule"
    assert positional[0] in STATE | OUTPUT, name
    assert "model_output" in positional, name


@pytest.mark.parametrize("name", sorted(OPS))
def test_per_sample_tensors_and_options_are_keyword_only(name):
    params = inspect.signature(OPS[name]).parameters
    for p in params.values():
        if p.name in PER_SAMPLE:
            assert p.kind == p.KEYWORD_ONLY, f"{name}: {p.name} must be keyword-only"
        elif _category(p.name) is None:
            assert p.kind == p.KEYWORD_ONLY, f"{name}: option {p.name} must be keyword-only"


def test_a_positional_swap_of_old_log_prob_and_advantages_is_refused():
    """Before the rule, grpo_loss(x, v, x', sigmas, i, advantages, old_log_prob) gave a plausible loss."""
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(2, 4, 8, generator=g), torch.randn(2, 4, 8, generator=g)
    sigmas = torch.cat([torch.tensor([0.9]), torch.linspace(0.8, 0.0, 5)])
    out = flowrl.sde_step(x, v, sigmas, 1, generator=g)
    adv = torch.tensor([1.0, -1.0])
    with pytest.raises(TypeError, match="positional"):
        losses.grpo_loss(x, v, out.prev_sample, sigmas, 1, adv, out.log_prob, clip_range=0.2)
    res = losses.grpo_loss(x, v, out.prev_sample, sigmas, 1, old_log_prob=out.log_prob, advantages=adv,
                           clip_range=0.2)
    assert torch.equal(res.ratio, torch.ones(2))


def test_a_schedulers_rollout_shows_the_recorders_options():
    """``help(pipe.scheduler.rollout)`` lists the recorder's options (declared once, on its constructor),
    with DDIM's own defaults; an unknown option is refused by name."""
    from flowrl.rollout.ddim import DDIMScheduler
    from flowrl.rollout.recorder import RolloutRecorder

    recorder = list(inspect.signature(RolloutRecorder.__init__).parameters.values())[2:]
    flow = inspect.signature(flowrl.FlowMatchEulerDiscreteScheduler().rollout)
    ddim = inspect.signature(DDIMScheduler().rollout)
    assert list(flow.parameters.values()) == recorder
    assert [p.name for p in ddim.parameters.values()] == [p.name for p in recorder]
    assert ddim.parameters["mode"].default == "ddim" and ddim.parameters["noise_level"].default == 1.0
    assert all(p.kind == p.KEYWORD_ONLY for p in flow.parameters.values())
    with pytest.raises(TypeError, match="noise_levle"):
        flowrl.FlowMatchEulerDiscreteScheduler().rollout(noise_levle=0.5)


@pytest.mark.parametrize("name", sorted(OPS))
def test_log_prob_names_a_tensor_and_log_prob_kind_the_string(name):
    """docs/guide.md, Names: no op takes a string ``log_prob=`` (the kind is ``log_prob_kind=``)."""
    params = inspect.signature(OPS[name]).parameters
    assert "log_prob" not in params, name
    if "log_prob_kind" in params:
        assert params["log_prob_kind"].default == "gaussian" and params["log_prob_kind"].kind == inspect.Parameter.KEYWORD_ONLY


def test_a_trajectory_and_a_recorder_name_the_kind_log_prob_kind():
    from flowrl.rollout.recorder import RolloutRecorder

    assert "log_prob_kind" in flowrl.RolloutTrajectory.__dataclass_fields__
    assert "log_prob" not in flowrl.RolloutTrajectory.__dataclass_fields__
    assert "log_prob_kind" in inspect.signature(RolloutRecorder.__init__).parameters
