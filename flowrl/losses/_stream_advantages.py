"""``nft_loss`` with per-stream advantages on a joint step (OmniNFT's modality-wise advantages; docs/losses.md,
Joint steps, "Per-stream advantages").

Given ``advantages`` as a tuple of [B] tensors, one per stream (in the order of the stream tuples), each
stream's DiffusionNFT loss is computed on its own (its own per-sample means over its own elements, its
own adaptive weights w+- and its own r from its own advantage) and the streams' results are added with
``stream_weights``:

    loss = sum_k w_k nft_loss(stream k, advantages=A_k)  (every field of NFTLossOutput the same sum),

w = ``stream_weights`` as given (None: 1/n each, OmniNFT's default of equal modality weights). This is
verl-omni's OmniNFT loss (``OmniNFTLoss``, verl-project/verl-omni commit
dc5e74928099d526f318096a3f93b3a44d45b5e8, verl_omni/trainer/diffusion/diffusion_algos.py): per modality
``_compute_modality_loss``, then (w_v (P_v + c_v K_v) + w_a (P_a + c_a K_a)) / (w_v + w_a); flowrl takes the
weights as given (pass w / sum(w) for theirs) and one ``kl_coef`` for every stream.

Each stream's term is the single-stream ``nft_loss`` bit for bit: one fused pass per stream (the backend's
``flow_sums``), through the custom op ``flowrl::nft_loss`` once per stream while ``torch.compile`` traces and
on an empty batch (B = 0: its zeros, on every stream's graph). This is not the shared-advantage joint step's
definition (one per-sample mean over every stream's elements, one w+- per sample): the two coincide only
for one stream.
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch

from ..ops._custom_ops import is_empty, traced
from ..ops.functional import combine_streams
from . import _custom_ops as _ops
from ._common import _check_per_sample
from ._flow import NFTLossOutput, nft_from_args
from ._joint import stream_arguments_of


def nft_loss(stream_args, tensors, options, stream_weights) -> NFTLossOutput:
    """``nft_loss`` of a joint step with a tuple of per-stream advantages (``options.advantages``).
    ``stream_args``: ``flowrl.losses._nft_args`` (one stream's validation); ``tensors``: nft_loss's
    (noised_sample, model_output, old_model_output, clean_sample, sigma, ref_model_output) as given; ``shard``
    is refused for a joint step by the caller."""
    noised_sample, model_output, old_model_output, clean_sample, sigma, ref_model_output = tensors
    advantages = options.advantages
    if not isinstance(noised_sample, tuple):
        raise ValueError("advantages: a tuple of per-stream advantages needs a joint step (noised_sample, "
                         "model_output, old_model_output and clean_sample as tuples of streams); pass one [B] "
                         "tensor for one stream")
    n = len(noised_sample)
    if n and len(advantages) != n:
        raise ValueError(f"advantages must hold one [B] tensor per stream ({n}), in the streams' order, or be one "
                         f"[B] tensor shared by every stream; got {len(advantages)} entries")

    def options_of(k):  # stream k's options: its own advantage, named here (the rest by stream_args)
        x = noised_sample[k]
        if isinstance(x, torch.Tensor) and x.dim() >= 1:
            _check_per_sample(f"advantages[{k}]", advantages[k], x.shape[0], x.device)
        return dict(options=replace(options, advantages=advantages[k]))

    streams = [("noised_sample", noised_sample, "tuple"), ("model_output", model_output, "tuple"),
               ("old_model_output", old_model_output, "tuple"), ("clean_sample", clean_sample, "tuple"),
               ("sigma", sigma, "shared"), ("ref_model_output", ref_model_output, "optional")]
    _, per_stream, weights = stream_arguments_of(stream_args, streams, stream_weights, options_of)
    if weights is None:
        weights = (1.0 / n,) * n
    # each stream: the single-stream nft_loss (eager, or the custom op while compiling and on B = 0)
    outs = [_ops.nft_loss(*args) if traced() or is_empty(args[1]) else nft_from_args(*args) for args in per_stream]
    # every field sum_k w_k (stream k's), left to right: combine_streams' weighted "sum" (it reads no count there;
    # the streams' element counts are given as its signature asks)
    counts = [torch.tensor(float(math.prod(args[1].shape[1:]))) for args in per_stream]
    return NFTLossOutput(*(None if outs[0][j] is None else
                           combine_streams([out[j] for out in outs], counts, "sum", weights)
                           for j in range(len(NFTLossOutput._fields))))
