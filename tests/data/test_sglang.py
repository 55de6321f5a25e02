"""SGLang ``/rollout/generate`` responses in and out of ``RolloutTrajectory``.

The responses are built here the way SGLang builds them (sgl-project/sglang,
python/sglang/multimodal_gen/runtime/entrypoints/post_training/rollout_api.py: ``_build_response`` slices
every batch tensor whose dim 0 is the batch size to the sample with ``_extract_single_sample_tensor``,
serializes ``dit_trajectory.timesteps`` and ``.sigmas`` once, unsliced, and encodes tensors with
``_maybe_serialize`` from .../post_training/utils.py: ``{"__tensor__": true, "data": base64(safetensors
{"t": tensor}), "shape", "dtype": str(dtype)}``; field names from .../post_training/io_struct.py
``RolloutResponse`` and .../runtime/post_training/rl_dataclasses.py). SGLang's log-prob of a step
(.../runtime/post_training/scheduler_rl_mixin.py ``flow_sde_sampling``) is computed from the float32
noise of the float32 sample, and the pipeline keeps the sample in the latents' dtype."""
import copy
import json
import sys

import msgpack
import pytest
import torch

import flowrl
import flowrl.backends.reference
from flowrl.data.serialization import to_wire
from flowrl.data.sglang import SGLangDenoisingEnv, from_sglang, to_sglang

B, T, SHAPE = 2, 4, (4, 6)
REQUEST = {"prompt": "p", "rollout_sde_type": "sde", "rollout_noise_level": 0.7, "rollout_log_prob_no_const": False}


def rollout(batch=B, steps=T, dtype=torch.float32, debug=False, **options):
    """A real flowrl rollout of a hand-written velocity loop."""
    sched = flowrl.FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(steps)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, *SHAPE, generator=g).to(dtype)
    w = torch.randn(SHAPE[-1], SHAPE[-1], generator=g).to(dtype)
    with sched.rollout(generator=[torch.Generator().manual_seed(i) for i in range(batch)], debug=debug, **options) as rec:
        for t in sched.timesteps:
            x = sched.step(x @ w * (t / 1000), t, x).prev_sample
    return rec.trajectory()


def sglang_responses(traj, *, timesteps="all", env=None, debug=None, raw_bytes=False):
    """Per-sample responses as SGLang's _build_response writes them, from a batch trajectory (raw_bytes:
    the released servers' envelopes, as their msgpack body hands them to a client)."""
    steps = traj.latent_step_indices
    if timesteps == "all":  # T timesteps, K = T + 1 latents
        ts = traj.timesteps
    else:  # the timestep of each kept latent (the final latent's: the schedule's terminal 0)
        ts = torch.cat([traj.timesteps, traj.timesteps.new_zeros(1)])[steps]
    out = []
    for i in range(traj.batch_size):
        r = {"request_id": "r", "prompt": "p", "seed": 0, "generated_output": None,
             "rollout_log_probs": traj.log_probs[i].contiguous(),
             "rollout_debug_tensors": None if debug is None else {k: v[i] for k, v in debug.items()},
             "denoising_env": None if env is None else env[i],
             "dit_trajectory": {"latents": traj.latents[i].contiguous(), "timesteps": ts, "sigmas": traj.sigmas},
             "inference_time_s": 1.0, "peak_memory_mb": None}
        out.append(to_wire(r, raw_bytes=raw_bytes))
    return out


def assert_same(a, b):
    for name in ("latents", "log_probs", "timesteps", "sigmas", "latent_step_indices"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    assert (a.mode, a.noise_level, a.log_prob_kind, a.reduction) == (b.mode, b.noise_level, b.log_prob_kind, b.reduction)
    assert (a.sde_steps is None) == (b.sde_steps is None)
    if a.sde_steps is not None:
        assert torch.equal(a.sde_steps, b.sde_steps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_from_sglang_builds_the_batch_trajectory(dtype):
    traj = rollout(dtype=dtype)
    responses = sglang_responses(traj)
    raw = sglang_responses(traj, raw_bytes=True)  # sglang 0.5.20-0.5.23: raw bytes, a msgpack body
    for given in (responses, json.dumps(responses), raw, msgpack.packb(raw), bytearray(msgpack.packb(raw))):
        got = from_sglang(given, request=REQUEST)
        assert_same(got, traj)
    # one response (or its JSON text): a batch of one
    one = from_sglang(json.dumps(responses[1]), request=REQUEST)
    assert one.batch_size == 1 and torch.equal(one.latents[0], traj.latents[1])
    # the recompute from the decoded trajectory gives the rollout's log-probs bit for bit
    g = torch.Generator().manual_seed(0)
    torch.randn(B, *SHAPE, generator=g)
    w = torch.randn(SHAPE[-1], SHAPE[-1], generator=g).to(dtype)
    got = from_sglang(responses, request=REQUEST)
    for j in range(T):
        x = got.latents[:, j].contiguous()  # the rollout's layout: CPU matmul may round a strided view differently
        v = x @ w * (got.timesteps[j] / 1000)
        assert torch.equal(got.step_log_prob(j, v), traj.log_probs[:, j])


def test_filtered_steps_from_timesteps_and_settings_mapping():
    traj = rollout(return_step_indices=[0, 2, 4], sde_steps=[0, 1], mode="cps", noise_level=0.5, log_prob_kind="sq_err")
    assert traj.latents.shape[1] == 3
    request = {"rollout_sde_type": "cps", "rollout_noise_level": 0.5, "rollout_log_prob_no_const": True,
               "rollout_sde_step_indices": [0, 1], "rollout_return_step_indices": [0, 2, 4]}
    got = from_sglang(sglang_responses(traj, timesteps="kept"), request=request)
    assert got.latent_step_indices.tolist() == [0, 2, 4]
    assert (got.mode, got.noise_level, got.log_prob_kind) == ("cps", 0.5, "sq_err")
    assert got.sde_steps.tolist() == [0, 1]
    assert torch.equal(got.timesteps, traj.timesteps)  # the loop's timesteps, from the schedule
    assert_same(got, traj)


@pytest.mark.parametrize("batch, steps", [(4, 4), (5, 4)], ids=["B=T", "B=T+1"])
def test_schedule_length_equal_to_batch_size_is_never_sliced(batch, steps):
    traj = rollout(batch=batch, steps=steps)
    got = from_sglang(sglang_responses(traj), request=REQUEST)
    assert got.sigmas.shape == (steps + 1,) and got.timesteps.shape == (steps,)
    assert got.latents.shape == (batch, steps + 1, *SHAPE) and got.log_probs.shape == (batch, steps)
    assert_same(got, traj)


@pytest.mark.parametrize("server", flowrl.data.sglang.SERVERS)
def test_to_sglang_round_trips_bit_for_bit_with_debug_tensors_and_env(server):
    encode = msgpack.packb if server == "0.5.23" else json.dumps
    for traj in (rollout(dtype=torch.bfloat16, debug=True),
                 rollout(return_step_indices=[1, 3], sde_steps=[2], log_prob_kind="sq_err", noise_level=0.3)):
        responses = to_sglang(traj, server=server, request_id="r", seed=3)
        assert len(responses) == traj.batch_size and responses[0]["seed"] == 3
        dit = responses[0]["dit_trajectory"]
        if server == "0.5.23":  # raw bytes; one timestep per kept latent; no latent_step_indices
            assert isinstance(dit["latents"]["data"], bytes) and "latent_step_indices" not in dit
            assert from_sglang(responses).timesteps.equal(traj.timesteps)
        else:
            assert isinstance(dit["latents"]["data"], str) and "latent_step_indices" in dit
        body = encode(responses)
        back = from_sglang(body)  # to_sglang writes the settings into every response
        assert_same(back, traj)
        if traj.debug_tensors is not None:
            for k, v in traj.debug_tensors.as_dict().items():
                assert torch.equal(getattr(back.debug_tensors, k), v), k
        again = to_sglang(back, server=server, request_id="r", seed=3)
        assert encode(again) == body
    with pytest.raises(ValueError, match="server must be one of"):
        to_sglang(traj, server="0.4")
    # SGLang's denoising_env dicts travel per sample, unchanged
    traj = rollout()
    env = [{"image_kwargs": None, "pos_cond_kwargs": {"encoder_hidden_states": torch.randn(3, 2) + i, "mask": [1, 2]},
            "neg_cond_kwargs": None, "guidance": torch.tensor([3.5])} for i in range(B)]
    got = from_sglang(sglang_responses(traj, env=env), request=REQUEST)
    assert isinstance(got.denoising_env, SGLangDenoisingEnv) and len(got.denoising_env) == B
    assert torch.equal(got.denoising_env.samples[1]["pos_cond_kwargs"]["encoder_hidden_states"],
                       env[1]["pos_cond_kwargs"]["encoder_hidden_states"])
    with pytest.raises(TypeError, match="SGLang denoising_env"):
        got.model_inputs(0)
    assert json.dumps(to_sglang(got, server="078e5e2a")[1]["denoising_env"]) == json.dumps(to_wire(env[1]))


def _mutations():
    """(name, mutate(list of responses), request or None, error pattern)."""

    def drop(path):
        def f(rs):
            d = rs[0]
            for k in path[:-1]:
                d = d[k]
            del d[path[-1]]
        return f

    def set_(path, value, sample=0):
        def f(rs):
            d = rs[sample]
            for k in path[:-1]:
                d = d[k]
            d[path[-1]] = value(d[path[-1]]) if callable(value) else value
        return f

    t = lambda x: to_wire(x)  # noqa: E731
    return [
        ("no dit_trajectory", drop(["dit_trajectory"]), REQUEST, r"\[0\]\['dit_trajectory'\]: is missing"),
        ("no latents", drop(["dit_trajectory", "latents"]), REQUEST, r"\['latents'\]: is missing"),
        ("no timesteps", drop(["dit_trajectory", "timesteps"]), REQUEST, r"\['timesteps'\]: is missing"),
        ("no sigmas", drop(["dit_trajectory", "sigmas"]), REQUEST, r"\['sigmas'\]: is missing"),
        ("no log-probs", drop(["rollout_log_probs"]), REQUEST, r"rollout_log_probs'\]: must be a tensor"),
        ("extra key", set_(["dit_trajectory", "extra"], 1), REQUEST, "unexpected keys"),
        ("sigmas increasing", set_(["dit_trajectory", "sigmas"], t(torch.tensor([0.0, 0.5, 0.6, 0.8, 1.0]))),
         REQUEST, r"\['sigmas'\]"),
        ("per-sample sigmas differ", set_(["dit_trajectory", "sigmas"], t(torch.tensor([1.0, 0.7, 0.5, 0.2, 0.0])), 1),
         REQUEST, "per-sample schedules disagree"),
        ("per-sample timesteps differ", set_(["dit_trajectory", "timesteps"], t(torch.tensor([999.0, 700, 500, 200])), 1),
         REQUEST, "per-sample schedules disagree"),
        ("latents differ in shape", set_(["dit_trajectory", "latents"], t(torch.zeros(T + 1, 4, 5)), 1), REQUEST,
         r"\[1\]\['dit_trajectory'\]\['latents'\]"),
        ("latents not float", set_(["dit_trajectory", "latents"], t(torch.zeros(T + 1, 4, 6, dtype=torch.int32))),
         REQUEST, "must be a float tensor"),
        ("log-probs length", set_(["rollout_log_probs"], t(torch.zeros(T + 1))), REQUEST, r"must be float32 \[T\]"),
        ("log-probs dtype", set_(["rollout_log_probs"], t(torch.zeros(T, dtype=torch.float64))), REQUEST, "float32"),
        ("fewer latents than timesteps", lambda rs: [r["dit_trajectory"].__setitem__("latents", t(torch.zeros(3, *SHAPE)))
                                                     for r in rs], REQUEST,
         r"\['timesteps'\]: has 4 entries for 3 latents"),
        ("bad envelope", set_(["dit_trajectory", "latents"], lambda e: {**e, "data": e["data"][:-8] + "!!!!!!!!"}),
         REQUEST, r"latents'\]: data is not valid base64"),
        ("no settings", lambda rs: None, None, "pass request="),
        ("settings disagree", set_(["rollout_noise_level"], 0.9), REQUEST, "disagrees with the request"),
        ("bad sde type", lambda rs: None, {**REQUEST, "rollout_sde_type": "dance"}, "rollout_sde_type"),
        ("bad noise level", lambda rs: None, {**REQUEST, "rollout_noise_level": "0.7"}, "rollout_noise_level"),
        ("bad no_const", lambda rs: None, {**REQUEST, "rollout_log_prob_no_const": 1}, "rollout_log_prob_no_const"),
        ("return steps disagree", lambda rs: None, {**REQUEST, "rollout_return_step_indices": [0, 4]},
         "rollout_return_step_indices"),
        ("debug for one sample only", set_(["rollout_debug_tensors"], {k: t(torch.zeros(1)) for k in (
            "rollout_variance_noises", "rollout_prev_sample_means", "rollout_noise_std_devs", "rollout_model_outputs")}),
         REQUEST, "some samples and missing for others"),
        ("debug keys", set_(["rollout_debug_tensors"], {"x": 1}), REQUEST, "rollout_debug_tensors"),
        ("env not a dict", set_(["denoising_env"], [1]), REQUEST, "denoising_env"),
        ("sample not a dict", lambda rs: rs.__setitem__(1, 3), REQUEST, r"\[1\] must be a dict"),
    ]


@pytest.mark.parametrize("name, mutate, request_, pattern", _mutations(), ids=[m[0] for m in _mutations()])
def test_malformed_responses_are_refused_naming_the_field(name, mutate, request_, pattern):
    responses = copy.deepcopy(sglang_responses(rollout()))
    mutate(responses)
    with pytest.raises(ValueError, match=pattern):
        from_sglang(responses, request=request_)


def test_malformed_filtered_timesteps_and_containers_are_refused():
    traj = rollout(return_step_indices=[0, 2, 4])
    request = {**REQUEST, "rollout_return_step_indices": [0, 2, 4]}
    good = sglang_responses(traj, timesteps="kept")
    assert from_sglang(good, request=request).latent_step_indices.tolist() == [0, 2, 4]
    for bad_ts, pattern in ((torch.tensor([999.0, 123.0, 0.0]), "matches no step"),
                            (torch.cat([traj.timesteps[[2, 0]], traj.timesteps.new_zeros(1)]), "not strictly increasing")):
        rs = copy.deepcopy(good)
        for r in rs:
            r["dit_trajectory"]["timesteps"] = to_wire(bad_ts)
        with pytest.raises(ValueError, match=pattern):
            from_sglang(rs, request=request)
    # all T + 1 timesteps with filtered latents (SGLang records every step's timestep): the request names them
    rs = copy.deepcopy(good)
    for r in rs:
        r["dit_trajectory"]["timesteps"] = to_wire(torch.cat([traj.timesteps, traj.timesteps.new_zeros(1)]))
    assert from_sglang(rs, request=request).latent_step_indices.tolist() == [0, 2, 4]
    with pytest.raises(ValueError, match="has 5 entries for 3 latents"):
        from_sglang(rs, request=REQUEST)
    rs = copy.deepcopy(good)
    rs[0]["dit_trajectory"]["latent_step_indices"] = to_wire(torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="latent_step_indices"):
        from_sglang(rs, request=request)
    for bad in ([], 3, "not json", "[1, 2"):
        with pytest.raises(ValueError, match="SGLang response"):
            from_sglang(bad, request=REQUEST)


def test_sglang_log_probs_score_the_float32_sample_not_the_returned_one(capsys):
    """Why a trainer recomputes the old log-probs with flowrl: SGLang scores the float32 sample
    (its log-prob is built from the float32 noise), then the pipeline keeps the sample in bf16, so
    the log-prob a trainer recomputes from the returned latents differs from SGLang's. Measured here on
    a 20-step shift-3 schedule, bf16 latents 16 x 64 x 64, noise level 0.7: the first-update ratio
    exp(recomputed - returned) then is off by the printed amount (docs/replay.md), where flowrl's own
    recorder, which scores the emitted bf16 sample, gives exactly 1."""
    steps, batch = 20, 2
    sched = flowrl.FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(steps)
    sigmas = sched.sigmas
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 16, 64, 64, generator=g).bfloat16()
    per_step = []
    for j in range(steps):
        v = (torch.randn(x.shape, generator=g) * 0.5 - x.float()).bfloat16()
        sglang = flowrl.sde_step(x, v, sigmas, j, noise_level=0.7, out_dtype=torch.float32, generator=g, backend="torch")
        returned = sglang.prev_sample.bfloat16()  # what the response's latents hold
        recomputed = flowrl.step_log_prob(x, v, returned, sigmas, j, noise_level=0.7, backend="torch")
        per_step.append(float((torch.exp(recomputed.double() - sglang.log_prob.double()) - 1).abs().max()))
        x = returned
    worst, before_last = max(per_step), max(per_step[:-1])
    assert worst > 1e-2 and before_last > 1e-4  # real ratio errors, far above float32 rounding
    own = rollout(dtype=torch.bfloat16)
    g2 = torch.Generator().manual_seed(0)
    torch.randn(B, *SHAPE, generator=g2)
    w = torch.randn(SHAPE[-1], SHAPE[-1], generator=g2).bfloat16()
    for j in range(T):
        v = own.latents[:, j].contiguous() @ w * (own.timesteps[j] / 1000)
        assert torch.equal(torch.exp(own.step_log_prob(j, v) - own.log_probs[:, j]), torch.ones(B))
    with capsys.disabled():
        print(f"\n[sglang] |ratio - 1| from SGLang's float32-sample log-probs at bf16, 20 steps: max {worst:.3g} "
              f"(the last step, sigma {float(sigmas[-2]):.3g}), {before_last:.3g} over the other steps")


# ------------------------------------------------------------------------------------------------------
# issue 23, item 5: extra_sampling_params, unknown keys, NaN log-probs, step filters past T

SGLANG_COMMIT = "078e5e2a5227bb6af1727574bb6212f0afb25250"  # sgl-project/sglang, rollout_api.py
# SamplingParams' rollout defaults (RLRolloutArgs; the step filters default to None = all steps)
SAMPLING_PARAMS_DEFAULTS = {"rollout_sde_type": "sde", "rollout_noise_level": 0.7, "rollout_log_prob_no_const": False,
                            "rollout_sde_step_indices": None, "rollout_return_step_indices": None}


def server_settings(request):
    """The settings the server runs with, transcribed from rollout_api.py ``_build_sampling_kwargs`` (commit
    above): RolloutRequest's fields (its defaults for omitted ones), ``update(extra_sampling_params)``,
    every None dropped, then SamplingParams' default for a dropped key."""
    kwargs = {k: request.get(k, SAMPLING_PARAMS_DEFAULTS[k]) for k in SAMPLING_PARAMS_DEFAULTS}
    if request.get("extra_sampling_params"):
        kwargs.update(request["extra_sampling_params"])
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    return {k: kwargs.get(k, SAMPLING_PARAMS_DEFAULTS[k]) for k in SAMPLING_PARAMS_DEFAULTS}


def velocity_weight(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    torch.randn(B, *SHAPE, generator=g)
    return torch.randn(SHAPE[-1], SHAPE[-1], generator=g).to(dtype)


@pytest.mark.parametrize("request_", [
    {"rollout_sde_type": "sde", "rollout_noise_level": 0.7,
     "extra_sampling_params": {"rollout_sde_type": "cps", "rollout_noise_level": 0.3, "guidance_scale": 4.5}},
    {"extra_sampling_params": {"rollout_sde_type": "cps", "rollout_noise_level": 0.3}},  # top-level defaults
    {"rollout_sde_type": "cps", "rollout_noise_level": 0.3, "extra_sampling_params": {"num_inference_steps": T}},
    {"rollout_sde_type": "cps", "rollout_noise_level": 0.3, "extra_sampling_params": None},
], ids=["extra-overrides", "extra-over-defaults", "extra-without-settings", "extra-null"])
def test_extra_sampling_params_resolve_as_the_server_does(request_):
    """A server that ran cps at noise 0.3 because extra_sampling_params said so is read as cps at 0.3
    (issue 23: it was read as sde at 0.7), and the recompute then gives ratio exactly 1."""
    traj = rollout(mode="cps", noise_level=0.3)
    assert server_settings(request_)["rollout_sde_type"] == "cps"
    assert server_settings(request_)["rollout_noise_level"] == 0.3
    got = from_sglang(sglang_responses(traj), request=request_)
    assert (got.mode, got.noise_level) == ("cps", 0.3)
    w = velocity_weight()
    for j in range(T):
        v = got.latents[:, j].contiguous() @ w * (got.timesteps[j] / 1000)
        assert torch.equal(torch.exp(got.step_log_prob(j, v) - got.log_probs[:, j]), torch.ones(B))


@pytest.mark.parametrize("request_", [
    {"rollout_noise_level": 0.3, "extra_sampling_params": {"rollout_noise_level": None}},  # null: the default
    {"rollout_sde_type": "cps", "extra_sampling_params": {"rollout_sde_type": "sde", "rollout_log_prob_no_const": True}},
    {"rollout_log_prob_no_const": True, "extra_sampling_params": {"rollout_log_prob_no_const": False}},
    {"rollout_sde_step_indices": [0], "extra_sampling_params": {"rollout_sde_step_indices": None}},
    {"rollout_sde_step_indices": [0, 1], "extra_sampling_params": {"rollout_sde_step_indices": [1, 2]}},
    {"extra_sampling_params": {"rollout_return_step_indices": [0, 2, 4]}},
], ids=["null-override", "type-and-const", "const-false", "sde-steps-null", "sde-steps", "return-steps"])
def test_resolved_settings_equal_the_transcribed_server(request_):
    settings = server_settings(request_)
    traj = rollout(mode=settings["rollout_sde_type"], noise_level=settings["rollout_noise_level"],
                   log_prob_kind="sq_err" if settings["rollout_log_prob_no_const"] else "gaussian",
                   sde_steps=settings["rollout_sde_step_indices"], return_step_indices=settings["rollout_return_step_indices"])
    got = from_sglang(sglang_responses(traj, timesteps="all" if traj.latents.shape[1] == T + 1 else "kept"),
                      request=request_)
    assert_same(got, traj)
    assert got.mode == settings["rollout_sde_type"] and got.noise_level == settings["rollout_noise_level"]
    assert (got.sde_steps is None) == (settings["rollout_sde_step_indices"] is None)


def test_extra_sampling_params_errors_name_where_the_setting_came_from():
    responses = sglang_responses(rollout())
    with pytest.raises(ValueError, match=r"request\['extra_sampling_params'\] must be an object or null"):
        from_sglang(responses, request={**REQUEST, "extra_sampling_params": [1]})
    with pytest.raises(ValueError, match=r"request\['extra_sampling_params'\]\['rollout_sde_type'\]: must be one of"):
        from_sglang(responses, request={**REQUEST, "extra_sampling_params": {"rollout_sde_type": "dance"}})
    with pytest.raises(ValueError, match=r"request\['extra_sampling_params'\]\['rollout_noise_level'\]: must be a number"):
        from_sglang(responses, request={**REQUEST, "extra_sampling_params": {"rollout_noise_level": "0.3"}})
    # settings a response carries are checked against the resolved ones
    carried = to_sglang(rollout())  # carries sde at 0.7
    with pytest.raises(ValueError, match=r"rollout_noise_level: 0.7 disagrees with the request's 0.3 \(from "
                                         r"request\['extra_sampling_params'\]\['rollout_noise_level'\]\)"):
        from_sglang(carried, request={**REQUEST, "extra_sampling_params": {"rollout_noise_level": 0.3}})


def test_unknown_keys_are_accepted_when_null_or_ignored_and_refused_otherwise():
    traj = rollout(debug=True)
    debug = traj.debug_tensors.as_dict()
    env = [{"image_kwargs": None, "pos_cond_kwargs": {"h": torch.randn(3, 2)}, "neg_cond_kwargs": None,
            "guidance": None} for _ in range(B)]
    good = sglang_responses(traj, env=env, debug=debug)
    # SGLang forks' documented-ignored keys, any value; any unknown key whose value is null
    accepted = copy.deepcopy(good)
    for r in accepted:
        r["dit_trajectory"]["model_timesteps"] = to_wire(traj.timesteps * 1.0)
        r["dit_trajectory"]["some_fork_field"] = None
        r["denoising_env"]["sample_layout"] = "BCHW"
        r["denoising_env"]["other"] = None
        r["rollout_debug_tensors"]["rollout_extra_debug"] = None
    got = from_sglang(accepted, request=REQUEST)
    assert_same(got, traj)
    assert got.denoising_env.samples[0]["sample_layout"] == "BCHW"  # kept as sent, not read
    for path, pattern in (
            (["dit_trajectory", "some_fork_field"], r"\[1\]\['dit_trajectory'\]\['some_fork_field'\]: unexpected keys "
                                                    r"\['some_fork_field'\]"),
            (["denoising_env", "other"], r"\[1\]\['denoising_env'\]\['other'\]: unexpected keys"),
            (["rollout_debug_tensors", "rollout_extra_debug"], r"\[1\]\['rollout_debug_tensors'\]\['rollout_extra_debug'\]")):
        bad = copy.deepcopy(accepted)
        d = bad[1]
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = 0
        with pytest.raises(ValueError, match=pattern):
            from_sglang(bad, request=REQUEST)
    assert set(flowrl.data.sglang.IGNORED_KEYS["dit_trajectory"]) == {"model_timesteps"}
    assert set(flowrl.data.sglang.IGNORED_KEYS["denoising_env"]) == {"sample_layout"}


def test_nan_log_probs_are_refused_naming_the_field_and_the_step():
    # the last cps step has std sigma' sin(eta pi / 2) = 0 (sigma' = 0): a gaussian log-prob there divides by 0
    sched = flowrl.FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(T)
    coef = flowrl.backends.reference.mode_coefficients(sched.sigmas, torch.tensor([T - 1]), flowrl.contract.Mode.CPS, 0.7,
                                              torch.float32)
    assert float(coef[2]) == 0.0
    responses = sglang_responses(rollout(mode="cps"))
    lp = flowrl.data.serialization.from_wire(responses[1]["rollout_log_probs"])
    lp[T - 1] = float("nan")
    responses[1]["rollout_log_probs"] = to_wire(lp)
    with pytest.raises(ValueError, match=rf"\[1\]\['rollout_log_probs'\]: is nan at loop step {T - 1} "
                                         rf"\(non-finite at steps \[{T - 1}\] of T = {T}\)"):
        from_sglang(responses, request={**REQUEST, "rollout_sde_type": "cps"})
    lp[T - 1], lp[0] = 0.0, float("-inf")
    responses[1]["rollout_log_probs"] = to_wire(lp)
    with pytest.raises(ValueError, match=r"\[1\]\['rollout_log_probs'\]: is -inf at loop step 0"):
        from_sglang(responses, request={**REQUEST, "rollout_sde_type": "cps"})


@pytest.mark.parametrize("field, values, upper", [
    ("rollout_return_step_indices", [0, 2, T + 1], T), ("rollout_return_step_indices", [-1, 2, 4], T),
    ("rollout_sde_step_indices", [0, T], T - 1)])
@pytest.mark.parametrize("place", ["top", "extra"])
def test_step_filters_past_t_name_the_field_and_t(field, values, upper, place):
    traj = rollout(return_step_indices=[0, 2, 4])
    request = ({**REQUEST, field: values} if place == "top"
               else {**REQUEST, "extra_sampling_params": {field: values}})
    named = rf"request\['{field}'\]" if place == "top" else rf"request\['extra_sampling_params'\]\['{field}'\]"
    bad = values[-1] if values[0] >= 0 else values[0]
    with pytest.raises(ValueError, match=rf"{named}: entry {bad} is outside \[0, {upper}\]: .* has T = {T} steps"):
        from_sglang(sglang_responses(traj, timesteps="kept"), request=request)


# ------------------------------------------------------------------------------------------------------
# the released servers' body (msgpack) and the sample SGLang's engine scored


def test_msgpack_bodies_are_decoded_strictly(monkeypatch):
    traj = rollout(debug=True)
    body = msgpack.packb(to_sglang(traj))
    assert_same(from_sglang(body), traj)
    with pytest.raises(ValueError, match="invalid msgpack body"):
        from_sglang(body[:-7])
    with pytest.raises(ValueError, match="exceeds max_bytes"):
        from_sglang(body, max_bytes=len(body) - 1)
    with pytest.raises(TypeError, match="body must be the response's bytes"):
        flowrl.data.sglang.decode_body("text")
    monkeypatch.setitem(sys.modules, "msgpack", None)
    with pytest.raises(ImportError, match="needs the msgpack package"):
        from_sglang(body)


def test_engine_prev_sample_is_mean_plus_noise_times_std_as_sglang_forms_it():
    """sglang 0.5.23 flow_sde_sampling: prev_sample = prev_sample_mean + variance_noise * noise_std_dev
    (a 0-d float32 std), before step() rounds it; its debug tensors carry the three factors."""
    traj = rollout(dtype=torch.bfloat16, debug=True)
    d = traj.debug_tensors
    for j in range(T):
        std = d.rollout_noise_std_devs[0, j].reshape(())
        expected = d.rollout_prev_sample_means[:1, j] + d.rollout_variance_noises[:1, j] * std
        assert torch.equal(flowrl.data.sglang.engine_prev_sample(traj, j)[:1], expected)
    with pytest.raises(ValueError, match="j must be a loop step"):
        flowrl.data.sglang.engine_prev_sample(traj, T)
    with pytest.raises(ValueError, match="needs the response's rollout_debug_tensors"):
        flowrl.data.sglang.engine_prev_sample(rollout(), 0)
