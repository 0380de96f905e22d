"""The shared decoder: Qwen3, Llama, Qwen3-MoE, GLM-4.5, DeepSeek-V3/V3.2, Qwen3-Next are this module with different
`ModelArgs`.

Each block has one token mixer, chosen per layer by `args.layer_type(i)` (`LAYER_KINDS`: the kind -> the attribute it
is stored under, HF's name, its constructor and its HF weight map): `full_attention` is GQA (`Attention`, optionally output-gated),
multi-head latent attention (`MLAttention`, when `args.mla` is set) or MLA restricted to an indexer's top-k keys
(`SparseMLAttention`, DeepSeek-V3.2, when `args.indexer` is set too), under `self_attn`; `linear_attention` is
Qwen3-Next's Gated DeltaNet (`GatedDeltaNet`) under `linear_attn`; `mamba` is Mamba-2 (`Mamba2`) and `mlp` an
ungated MLP (`MLP`), Nemotron-H's. Every mixer takes `(x, cos, sin, AttnInputs)`.

Blocks (`args.block`): `decoder` blocks (`DecoderBlock`) are norm + mixer + norm + MLP; `mixer` blocks
(`MixerBlock`, Nemotron-H) are norm + one mixer, stored under `mixer` whatever its kind (HF's layout).
Parameter names follow Hugging Face's (without the `model.` prefix) except the runtime fusions: `qkv_proj`,
`gate_up_proj`, the MoE `router` and stacked `experts`. `weight_map` puts the modules' own maps (`hf_weights`) together
under their blocks; `checkpoint.py` reads and writes through it.

`CausalLM.forward` returns `head(hidden, lm_head_weight)`, called inside the forward (`heads`: logits by
default, hidden states, token logprobs, SFT's summed NLL; RL's fused policy loss is a head of the trainer).

Vision-language models (`args.vision_config`, Qwen3-VL) add a vision tower (`visual`, `layers.vision`): a forward
given `Images` replaces each image's placeholder tokens' embeddings by the tower's output, adds its DeepStack
features to the hidden states after the first decoder layers, and rotates by M-RoPE positions
(`layers.rope.mrope_positions`); text-only batches run as the text decoder alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from .config import ModelArgs
from .heads import LOGITS, Head
from .hf_layout import HFLayout, WeightMap, nest, plain, same_names
from .layers.attention import Attention, AttnInputs, attention_inputs
from .layers.gated_deltanet import GatedDeltaNet
from .layers.indexer import SparseMLAttention
from .layers.kv_cache import CacheBatch, KVCache
from .layers.mamba2 import Mamba2
from .layers.mla import MLAttention
from .layers.mlp import MLP, GatedMLP
from .layers.moe import Experts, MoE, Router
from .layers.norm import RMSNorm
from .layers.precision import autocast_dtype
from .layers.qwen2_5_vision import Qwen2_5VisionArgs, Qwen2_5VisionEncoder
from .layers.rope import RotaryEmbedding, mrope_positions
from .layers.state_cache import StateBatch, StateCache
from .layers.vision import Qwen3VisionEncoder, VisionArgs
from .runtime import ModelRuntime

T = TypeVar("T")


def _attention_class(args: ModelArgs) -> type[Attention] | type[MLAttention]:
    """`full_attention`'s module: GQA, MLA (`args.mla`) or MLA narrowed by an indexer (`args.indexer`)."""
    if args.indexer is not None:
        return SparseMLAttention
    return MLAttention if args.mla is not None else Attention


def _attention(args: ModelArgs, layer_idx: int, runtime: ModelRuntime) -> nn.Module:
    return _attention_class(args)(args, layer_idx, runtime)


def _attention_weights(args: ModelArgs, layout: HFLayout) -> WeightMap:
    return _attention_class(args).hf_weights(args, layout)


@dataclass(frozen=True)
class LayerKind:
    """A token mixer: where a `DecoderBlock` keeps it, how it is built, how its tensors are named on disk. What
    it keeps between cached steps is `config.LAYER_CACHES[kind]` (read by `ModelArgs` and the caches, below)."""

    attribute: str
    """Its attribute (and HF name) in a `DecoderBlock`; a `MixerBlock` keeps every kind under `mixer`."""
    build: Callable[[ModelArgs, int, ModelRuntime], nn.Module]
    """`(args, layer_idx, runtime)` -> the module, called as `mixer(x, cos, sin, attn: AttnInputs)`."""
    hf_weights: Callable[[ModelArgs, HFLayout], WeightMap]
    """Its runtime tensors -> HF tensors, names relative to the mixer (`hf_layout`)."""


def _mlp_weights(args: ModelArgs, layout: HFLayout) -> WeightMap:
    return MLP.hf_weights(args.mlp_bias)


LAYER_KINDS: dict[str, LayerKind] = {
    "full_attention": LayerKind("self_attn", _attention, _attention_weights),
    "linear_attention": LayerKind("linear_attn", GatedDeltaNet, GatedDeltaNet.hf_weights),
    "mamba": LayerKind("mixer", Mamba2, Mamba2.hf_weights),
    "mlp": LayerKind("mixer", MLP.mixer, _mlp_weights),
    "moe": LayerKind("mixer", MoE.mixer, MoE.hf_weights),
}
"""`ModelArgs.layer_type(i)` -> its token mixer, one row per kind of `config.LAYER_CACHES`."""


class DecoderBlock(nn.Module):
    """Pre-norm token mixer (attention or linear attention) + MLP (dense or MoE). One FSDP / compile unit."""

    def __init__(self, args: ModelArgs, layer_idx: int, runtime: ModelRuntime) -> None:
        super().__init__()
        centered = args.zero_centered_norm
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, centered)
        self.layer_type = args.layer_type(layer_idx)
        kind = LAYER_KINDS[self.layer_type]
        self.mixer_name = kind.attribute
        self.add_module(self.mixer_name, kind.build(args, layer_idx, runtime))
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, centered)
        self.mlp: nn.Module
        if args.is_moe_layer(layer_idx):
            self.mlp = MoE.mixer(args, layer_idx, runtime)
        else:
            self.mlp = GatedMLP(
                args.hidden_size, args.intermediate_size, bias=args.mlp_bias, activation=runtime.swiglu_backend
            )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttnInputs) -> torch.Tensor:
        x = x + self.mixer(self.input_layernorm(x), cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))

    @property
    def mixer(self) -> nn.Module:
        """The token mixer (`self_attn` or `linear_attn`)."""
        return getattr(self, self.mixer_name)

    @staticmethod
    def hf_weights(args: ModelArgs, layout: HFLayout, layer_idx: int) -> WeightMap:
        """The norms, the mixer's tensors under its attribute and the MLP's (dense or MoE) under `mlp.`."""
        kind = LAYER_KINDS[args.layer_type(layer_idx)]
        out = same_names("input_layernorm.weight", "post_attention_layernorm.weight")
        out |= nest(f"{kind.attribute}.", kind.hf_weights(args, layout))
        if args.is_moe_layer(layer_idx):
            return out | nest("mlp.", MoE.hf_weights(args, layout))
        return out | nest("mlp.", GatedMLP.hf_weights(args.intermediate_size, args.mlp_bias))


class MixerBlock(nn.Module):
    """Nemotron-H's block: `x + mixer(norm(x))` with one mixer of any kind (attention, Mamba-2, MLP, MoE) under `mixer`.
    One FSDP / compile unit."""

    def __init__(self, args: ModelArgs, layer_idx: int, runtime: ModelRuntime) -> None:
        super().__init__()
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, fp32_scale=args.norm_fp32_scale)
        self.layer_type = args.layer_type(layer_idx)
        self.mixer_name = "mixer"
        self.mixer = LAYER_KINDS[self.layer_type].build(args, layer_idx, runtime)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttnInputs) -> torch.Tensor:
        return x + self.mixer(self.norm(x), cos, sin, attn)

    @staticmethod
    def hf_weights(args: ModelArgs, layout: HFLayout, layer_idx: int) -> WeightMap:
        """`norm` and the mixer's tensors under `mixer.`, whatever its kind."""
        kind = LAYER_KINDS[args.layer_type(layer_idx)]
        return same_names("norm.weight") | nest("mixer.", kind.hf_weights(args, layout))


BLOCKS: dict[str, type[DecoderBlock] | type[MixerBlock]] = {"decoder": DecoderBlock, "mixer": MixerBlock}
"""`ModelArgs.block` -> the block class: built `(args, layer_idx, runtime)`, named on disk by `hf_weights`."""


VISION_TOWERS: dict[str, Callable[[dict[str, Any]], nn.Module]] = {
    "qwen3_vl": lambda config: Qwen3VisionEncoder(VisionArgs.from_hf(config)),
    "qwen2_5_vl": lambda config: Qwen2_5VisionEncoder(Qwen2_5VisionArgs.from_hf(config)),
}
"""`ModelArgs.vision_tower` -> the vision tower, built from the HF `vision_config`."""


def vision_tower(args: ModelArgs) -> nn.Module | None:
    """The vision tower of a vision-language model (`args.vision_tower`); None for a text model."""
    return None if args.vision_tower is None else VISION_TOWERS[args.vision_tower](dict(args.vision_config or {}))


def weight_map(args: ModelArgs, layout: HFLayout) -> WeightMap:
    """Every runtime parameter of the model of `args` -> the HF tensors it is built from: the embedding, final
    norm and LM head under `layout`'s names, each block's `hf_weights` under `layers.{i}.`, and a vision tower's
    parameters under HF's own names (`model.visual.`)."""
    top = layout.prefix
    out = {
        "embed_tokens.weight": plain(f"{top}{layout.embed_tokens}.weight"),
        "norm.weight": plain(f"{top}{layout.final_norm}.weight"),
    }
    if not args.tie_word_embeddings:
        out["lm_head.weight"] = plain("lm_head.weight")
    block = BLOCKS[args.block]
    for i in range(args.num_layers):
        out |= nest(f"layers.{i}.", block.hf_weights(args, layout, i), f"{top}layers.{i}.")
    if args.vision_config is not None:
        with torch.device("meta"):
            tower = vision_tower(args)
        out |= nest("visual.", same_names(*(name for name, _ in tower.named_parameters())), "model.visual.")
    return out


@dataclass(frozen=True)
class Images:
    """A batch's images, in the order of their placeholder spans (row by row): patches `[P, C * T * p * p]` and
    each image's (t, h, w) patch grid `[N, 3]`, as transformers' image processor gives `pixel_values` and
    `image_grid_thw`."""

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    placeholders: torch.Tensor | None = None
    """`[B, S]` bool, True at the images' placeholder tokens; None: every `image_token_id` is one. Batches of
    sampled completions pass it: a completion may sample the placeholder id as text."""


@dataclass(frozen=True)
class VisualFeatures:
    """Where the images sit in a batch (`mask` `[B, S]`, True at placeholders) and what goes there: the tower's
    embeddings `[N, H]` replacing the placeholders' and the DeepStack features added after decoder layer i."""

    mask: torch.Tensor
    embeds: torch.Tensor
    deepstack: tuple[torch.Tensor, ...] = ()


class CausalLM(nn.Module):
    """Embedding, decoder blocks (`layers[i]`), final norm, LM head (absent when tied to the embedding), and for a
    vision-language model its vision tower (`visual`). `args` is the checkpoint's config, `runtime` the run's
    kernel choices."""

    def __init__(self, args: ModelArgs, runtime: ModelRuntime | None = None) -> None:
        super().__init__()
        self.args, self.runtime = args, runtime or ModelRuntime()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(BLOCKS[args.block](args, i, self.runtime) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, args.zero_centered_norm, args.norm_fp32_scale)
        self.rotary = RotaryEmbedding(args.rope, args.rotary_dim)
        self.lm_head = None if args.tie_word_embeddings else nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.visual = vision_tower(args)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """`[vocab, hidden]`: the LM head, or the embedding when tied."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Random init as Hugging Face does: normal(0, initializer_range) matrices, ones for norms (zeros when
        zero-centred), zero biases (the router's correction bias too), Gated DeltaNet's decay parameters."""
        std = self.args.initializer_range
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding | nn.Conv1d | nn.Conv3d):
                nn.init.normal_(module.weight, std=std, generator=generator)
            if isinstance(module, nn.Linear | nn.Conv3d) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, Router):
                nn.init.normal_(module.weight, std=std, generator=generator)
                if module.e_score_correction_bias is not None:
                    nn.init.zeros_(module.e_score_correction_bias)
            if isinstance(module, Experts):
                nn.init.normal_(module.w1, std=std, generator=generator)
                nn.init.normal_(module.down_proj, std=std, generator=generator)
            if isinstance(module, RMSNorm):
                module.reset_parameters()
            if isinstance(module, GatedDeltaNet | Mamba2):
                module.reset_parameters(generator)
            if isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
            if isinstance(module, nn.LayerNorm) and module.bias is not None:
                nn.init.zeros_(module.bias)
        self.rotary.init_buffers(self.embed_tokens.weight.device)

    def hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttnInputs, visual: VisualFeatures | None = None
    ) -> torch.Tensor:
        """Final (normed) hidden states `[B, S, hidden]` for token ids `[B, S]` at integer `positions` `[B, S]`
        (M-RoPE: `[3, B, S]`), with `visual`'s image features in place of their placeholders."""
        x = self.embed_tokens(input_ids)
        if visual is not None:
            x = x.masked_scatter(visual.mask[..., None], visual.embeds.to(x.dtype))
        # q and k come out of the matmuls in autocast's dtype; rotate them in it, as a bf16 model does
        cos, sin = self.rotary(positions, autocast_dtype(x.device.type) or x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, attn)
            if visual is not None and i < len(visual.deepstack):
                x = x.masked_scatter(visual.mask[..., None], x[visual.mask] + visual.deepstack[i].to(x.dtype))
        return self.norm(x)

    def _vision_trains(self) -> bool:
        return (
            self.visual is not None
            and torch.is_grad_enabled()
            and any(p.requires_grad for p in self.visual.parameters())
        )

    def _idle_vision(self, dtype: torch.dtype) -> torch.Tensor:
        """0 x the vision tower's output on one blank block of patches: a batch without images still gives every
        tower parameter a (zero) gradient, so data-parallel ranks reduce the same gradients whether or not their
        micro-batches held images (FSDP's reduce-scatter would otherwise disagree in size and abort)."""
        assert self.visual is not None
        merge = self.visual.args.spatial_merge_size
        device = self.embed_tokens.weight.device
        pixels = torch.zeros(merge * merge, self.visual.args.patch_dim, device=device)
        embeds, deepstack = self.visual(pixels, torch.tensor([[1, merge, merge]], device=device))
        return 0.0 * sum((t.sum() for t in (embeds, *deepstack)), torch.zeros((), device=device)).to(dtype)

    def visual_features(self, input_ids: torch.Tensor, images: Images) -> VisualFeatures:
        """The vision tower's features for `images` and where they go in `input_ids`; ValueError when the model
        has no vision tower or the placeholders do not count the images' merged patches."""
        if self.visual is None or self.args.image_token_id is None:
            raise ValueError(f"{self.args.architecture} takes no images (it has no vision tower)")
        embeds, deepstack = self.visual(images.pixel_values, images.grid_thw)
        mask = input_ids == self.args.image_token_id if images.placeholders is None else images.placeholders.bool()
        if int(mask.sum()) != embeds.shape[0]:
            raise ValueError(
                f"{int(mask.sum())} image placeholder tokens for {embeds.shape[0]} image features "
                f"({images.grid_thw.tolist()} patch grids)"
            )
        return VisualFeatures(mask, embeds, tuple(deepstack))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of hidden states `[..., H]` (inference's prefill and decode)."""
        return LOGITS(hidden, self.lm_head_weight)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        *,
        images: Images | None = None,
        head: Head[T] = LOGITS,
    ) -> T:
        """Score a batch `[B, S]`: `head(hidden [B, S, H], lm_head_weight [V, H])`, logits `[B, S, V]` by default.

        positions: restart at each packed document; attention stays inside documents. Default: 0..S-1.
        mask: `[B, S]`, 0 for padding (padding never affects real tokens).
        images: the batch's images (vision-language models): their features replace the placeholder tokens and
            positions become M-RoPE's.
        head: what the forward returns (`heads`: `Logits`, `Hidden`, `Logprobs` of targets, SFT's `NllSum`;
            RL's fused policy loss is the trainer's). Called here, inside the forward, where FSDP has the LM head
            unsharded.
        """
        batch, seq = input_ids.shape
        args = self.args
        attn = attention_inputs(self.runtime.attn_backend, input_ids.device, positions, mask, args.attention_head_dims)
        visual = None
        if images is not None:
            visual = self.visual_features(input_ids, images)
            merge = self.visual.args.spatial_merge_size
            rope_positions = mrope_positions(
                input_ids, self.args.image_token_id, images.grid_thw, merge, positions, mask, visual.mask
            )
        elif positions is None:
            rope_positions = torch.arange(seq, device=input_ids.device).expand(batch, seq)
        else:
            rope_positions = positions
        hidden = self.hidden_states(input_ids, rope_positions, attn, visual)
        if visual is None and self._vision_trains():
            hidden = hidden + self._idle_vision(hidden.dtype)
        return head(hidden, self.lm_head_weight)

    def prefill(
        self,
        input_ids: torch.Tensor,
        cache: KVCache,
        batch: CacheBatch,
        state: StateCache | None = None,
        state_batch: StateBatch | None = None,
        *,
        rope_positions: torch.Tensor | None = None,
        visual: VisualFeatures | None = None,
    ) -> torch.Tensor:
        """Run prompt chunks packed as `[T]`, filling the cache; logits `[N, V]` at each sequence's last token.

        Hybrid models (`args.is_hybrid`) also take the linear layers' `state` cache and the step's `state_batch`
        (`state.batch(slots, cached_lens)`, sequences in `batch`'s order). Vision-language models take the chunks'
        M-RoPE `rope_positions` `[3, T]` and their image features (`visual`, mask `[1, T]`).
        """
        hidden = self.cached_hidden_states(
            input_ids, cache, batch, state, state_batch, rope_positions=rope_positions, visual=visual
        )
        return self.compute_logits(hidden[batch.last_index])

    def decode(
        self,
        input_ids: torch.Tensor,
        cache: KVCache,
        batch: CacheBatch,
        state: StateCache | None = None,
        state_batch: StateBatch | None = None,
    ) -> torch.Tensor:
        """One new token per running sequence `[N]`; logits `[N, V]`."""
        if batch.unpack_index.shape[1] != 1:
            raise ValueError("decode takes exactly one new token per sequence; use prefill for more")
        return self._cached(input_ids, cache, batch, state, state_batch)

    def cached_hidden_states(
        self,
        input_ids: torch.Tensor,
        cache: KVCache,
        batch: CacheBatch,
        state: StateCache | None = None,
        state_batch: StateBatch | None = None,
        *,
        rope_positions: torch.Tensor | None = None,
        visual: VisualFeatures | None = None,
    ) -> torch.Tensor:
        """Like `prefill`, but the final hidden states `[T, H]` of every new token: prompt logprobs score them all."""
        if self.args.is_hybrid and (state is None or state_batch is None):
            raise ValueError(f"{self.args.architecture} has recurrent layers: pass a StateCache and StateBatch")
        attn = AttnInputs(cache=cache, cache_batch=batch, state=state, state_batch=state_batch)
        positions = batch.positions[None] if rope_positions is None else rope_positions[:, None]
        return self.hidden_states(input_ids[None], positions, attn, visual)[0]

    def _cached(
        self,
        input_ids: torch.Tensor,
        cache: KVCache,
        batch: CacheBatch,
        state: StateCache | None,
        state_batch: StateBatch | None,
    ) -> torch.Tensor:
        hidden = self.cached_hidden_states(input_ids, cache, batch, state, state_batch)
        return self.compute_logits(hidden[batch.last_index])
