"""A small decoder-only transformer in plain JAX, shaped like MaxText's use of the batch.

Attention is causal *and* restricted to the same document (`inputs_segmentation`), positions
come from `inputs_position`, and the loss is weighted by `targets_segmentation != 0`: every
token of a concatenated source (it never pads), so `total_weights == rows * seq_len` there; on
instruction data the untrained prompt tokens and whole-document row tails carry segment 0.
With the feed's `source` field in the batch (docs/observability.md) the step also reports the
loss of each source's rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    seq_len: int
    width: int = 128
    depth: int = 2
    heads: int = 4


def init_params(config: ModelConfig, key: jax.Array) -> dict:
    keys = iter(jax.random.split(key, 4 + 6 * config.depth))
    width = config.width

    def dense(shape: tuple[int, ...]) -> jax.Array:
        return jax.random.normal(next(keys), shape) * (shape[0] ** -0.5)

    return {
        "embed": jax.random.normal(next(keys), (config.vocab_size, width)) * 0.02,
        "position": jax.random.normal(next(keys), (config.seq_len, width)) * 0.02,
        "final_norm": jnp.ones(width),
        "layers": [
            {
                "attention_norm": jnp.ones(width),
                "qkv": dense((width, 3 * width)),
                "out": dense((width, width)),
                "mlp_norm": jnp.ones(width),
                "up": dense((width, 4 * width)),
                "down": dense((4 * width, width)),
            }
            for _ in range(config.depth)
        ],
    }


def _norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def _attention(layer: dict, x: jax.Array, mask: jax.Array, heads: int) -> jax.Array:
    rows, length, width = x.shape
    q, k, v = jnp.split(x @ layer["qkv"], 3, axis=-1)
    shape = (rows, length, heads, width // heads)
    q, k, v = (t.reshape(shape) for t in (q, k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(width // heads)
    scores = jnp.where(mask[:, None], scores, -1e9)
    mixed = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
    return mixed.reshape(rows, length, width) @ layer["out"]


def logits(params: dict, batch: dict, config: ModelConfig) -> jax.Array:
    segments = batch["inputs_segmentation"]
    length = segments.shape[1]
    causal = jnp.tril(jnp.ones((length, length), dtype=bool))
    mask = causal[None] & (segments[:, :, None] == segments[:, None, :])
    x = params["embed"][batch["inputs"]] + params["position"][batch["inputs_position"]]
    for layer in params["layers"]:
        x = x + _attention(layer, _norm(x, layer["attention_norm"]), mask, config.heads)
        hidden = jax.nn.gelu(_norm(x, layer["mlp_norm"]) @ layer["up"])
        x = x + hidden @ layer["down"]
    return _norm(x, params["final_norm"]) @ params["embed"].T


def loss_and_weights(params: dict, batch: dict, config: ModelConfig) -> tuple[jax.Array, dict]:
    out = logits(params, batch, config)
    losses = optax.softmax_cross_entropy_with_integer_labels(out, batch["targets"])
    weights = (batch["targets_segmentation"] != 0).astype(jnp.float32)
    total = weights.sum()
    rows = {"row_loss": (losses * weights).sum(-1), "row_weights": weights.sum(-1)}
    # with an `objective:`, each source's share of the loss; they average 1 over the trained
    # targets, so the loss keeps its scale (pipeline.read.objective)
    scaled = batch.get("loss_weights", weights)
    return (losses * scaled).sum() / jnp.maximum(total, 1.0), {"total_weights": total, **rows}


def optimizer(learning_rate: float) -> optax.GradientTransformation:
    return optax.adamw(learning_rate, b1=0.9, b2=0.95, weight_decay=0.01)


def batch_checksum(inputs: jax.Array) -> jax.Array:
    """An order-sensitive uint32 digest of a (global) batch of token ids."""
    flat = inputs.reshape(-1).astype(jnp.uint32)
    weights = jnp.arange(1, flat.size + 1, dtype=jnp.uint32) * jnp.uint32(2654435761)
    return jnp.sum((flat + 1) * weights)


def source_losses(aux: dict, source: jax.Array, num_sources: int) -> jax.Array:
    """Mean loss of each source's rows ([num_sources]; NaN for a source the step did not draw)."""
    ids = source.reshape(-1)
    total = jax.ops.segment_sum(aux["row_loss"].reshape(-1), ids, num_segments=num_sources)
    weights = jax.ops.segment_sum(aux["row_weights"].reshape(-1), ids, num_segments=num_sources)
    return jnp.where(weights > 0, total / jnp.maximum(weights, 1.0), jnp.nan)


def make_train_step(config: ModelConfig, tx: optax.GradientTransformation, num_sources: int = 0):
    """A jitted step over a batch with an optional leading micro-batch axis (grad_accum).
    With `num_sources`, the batch carries `source` and the metrics `source_loss`."""

    def micro(params, batch):
        return jax.value_and_grad(loss_and_weights, has_aux=True)(params, batch, config)

    def step(params, opt_state, batch):
        if batch["inputs"].ndim == 3:  # [grad_accum, rows, seq_len]: average the micro-batches
            (loss, aux), grads = jax.lax.scan(
                lambda carry, mb: (carry, micro(params, mb)), None, batch
            )[1]
            loss, grads = loss.mean(), jax.tree.map(lambda g: g.mean(axis=0), grads)
            aux = {**aux, "total_weights": aux["total_weights"].sum()}
        else:
            (loss, aux), grads = micro(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        checksum = batch_checksum(batch["inputs"])
        metrics = {"loss": loss, "total_weights": aux["total_weights"], "checksum": checksum}
        if num_sources:
            metrics["source_loss"] = source_losses(aux, batch["source"], num_sources)
        return optax.apply_updates(params, updates), opt_state, metrics

    return jax.jit(step, donate_argnums=(0, 1))
