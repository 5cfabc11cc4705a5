"""The plugin's attention backend: paged KV cache, GQA, multi-token queries.

One backend serves prefill, decode, chunked prefill and speculative
verification (``1 + k`` query tokens per request) alike: every request's
query tokens attend causally to its whole context through its block table.
The metadata is rebuilt from ``CommonAttentionMetadata`` at every step, for
the target and for each draft step separately, so nothing frozen at one step
leaks into another.
"""

from typing import ClassVar, Optional

import torch
from vllm.attention.backends.abstract import (AttentionBackend, AttentionImpl,
                                              AttentionLayer, AttentionType)
from vllm.config import VllmConfig
from vllm.v1.attention.backends.utils import (AttentionCGSupport,
                                              AttentionMetadataBuilder,
                                              CommonAttentionMetadata)
from vllm.v1.kv_cache_interface import AttentionSpec

from vllm_ascend.attention import graph_tasks
from vllm_ascend.attention.metadata import (AscendAttentionMetadata,
                                            AscendAttentionState,
                                            classify_batch)
from vllm_ascend.attention.paged_attention import get_paged_attention_ops
from vllm_ascend.device import npu_kernels

PAD_SLOT_ID = -1
# The dtype of the slot mapping the KV writes take (int32 on the NPU).
SLOT_MAPPING_DTYPE = torch.int32


class AscendAttentionBackend(AttentionBackend):
    accept_output_buffer: bool = True

    @staticmethod
    def get_name() -> str:
        return "ASCEND"

    @staticmethod
    def get_impl_cls() -> type["AscendAttentionImpl"]:
        return AscendAttentionImpl

    @staticmethod
    def get_metadata_cls() -> type["AscendAttentionMetadata"]:
        return AscendAttentionMetadata

    @staticmethod
    def get_builder_cls() -> type["AscendAttentionMetadataBuilder"]:
        return AscendAttentionMetadataBuilder

    @classmethod
    def get_supported_dtypes(cls) -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16, torch.float32]

    @staticmethod
    def get_kv_cache_shape(num_blocks: int,
                           block_size: int,
                           num_kv_heads: int,
                           head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)


class AscendAttentionMetadataBuilder(
        AttentionMetadataBuilder[AscendAttentionMetadata]):
    # Uniform batches (decode, and verify batches of 1 + k tokens per
    # request) are captured in full graphs, attention inside: its host
    # arguments are updated before each replay (graph_tasks.py). Mixed
    # batches run piecewise or eager.
    cudagraph_support: ClassVar[AttentionCGSupport] = (
        AttentionCGSupport.UNIFORM_BATCH)

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str],
                 vllm_config: VllmConfig, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        spec = vllm_config.speculative_config
        self.num_spec_tokens = (spec.num_speculative_tokens
                                if spec is not None else 0)
        # A graph reads the slots of its KV writes from one buffer: the
        # draft's slot mapping is a new tensor at every step. int32, the
        # dtype the KV write kernel takes: the copy into it casts once per
        # step, not once per layer (vllm-ascend keeps an int32 buffer too).
        self.slot_mapping = torch.full(
            (vllm_config.scheduler_config.max_num_batched_tokens, ),
            PAD_SLOT_ID, dtype=SLOT_MAPPING_DTYPE, device=device)

    def _persistent_slot_mapping(self, slot_mapping: torch.Tensor,
                                 num_tokens: int) -> torch.Tensor:
        if slot_mapping.data_ptr() != self.slot_mapping.data_ptr():
            self.slot_mapping[:num_tokens].copy_(slot_mapping[:num_tokens])
            self.slot_mapping[num_tokens:].fill_(PAD_SLOT_ID)
        return self.slot_mapping[:num_tokens]

    def build(self,
              common_prefix_len: int,
              common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> AscendAttentionMetadata:
        m = common_attn_metadata
        num_reqs = m.num_reqs
        query_start_loc_cpu = m.query_start_loc_cpu[:num_reqs + 1]
        seq_lens_cpu = m.seq_lens_cpu[:num_reqs]
        query_lens = query_start_loc_cpu[1:] - query_start_loc_cpu[:-1]
        state = classify_batch(query_lens, seq_lens_cpu, m.max_query_len)
        if (state == AscendAttentionState.CHUNKED_PREFILL
                and self.num_spec_tokens > 0
                and m.max_query_len <= 1 + self.num_spec_tokens):
            state = AscendAttentionState.SPEC_DECODING
        return AscendAttentionMetadata(
            num_actual_tokens=m.num_actual_tokens,
            num_reqs=num_reqs,
            max_query_len=m.max_query_len,
            max_seq_len=m.max_seq_len,
            query_start_loc=m.query_start_loc[:num_reqs + 1],
            query_start_loc_cpu=query_start_loc_cpu,
            seq_lens=m.seq_lens[:num_reqs],
            seq_lens_cpu=seq_lens_cpu,
            block_tables=m.block_table_tensor[:num_reqs],
            slot_mapping=self._persistent_slot_mapping(m.slot_mapping,
                                                       m.num_actual_tokens),
            attn_state=state,
            seq_lens_list=seq_lens_cpu.tolist(),
            query_ends=query_start_loc_cpu[1:].tolist(),
        )

    def build_for_drafting(self, common_attn_metadata: CommonAttentionMetadata,
                           draft_index: int) -> AscendAttentionMetadata:
        metadata = self.build(0, common_attn_metadata, fast_build=True)
        if draft_index > 0:
            metadata.seq_lens_list = draft_host_seq_lens(metadata)
        return metadata


def _draft_seq_lens_from_tensor(metadata: AscendAttentionMetadata
                                ) -> list[int]:
    """Exact lengths read from ``seq_lens``: on the CPU reference device
    that tensor is on the host, so reading it waits for nothing."""
    return metadata.seq_lens.tolist()


def _draft_seq_lens_known_on_host(metadata: AscendAttentionMetadata
                                  ) -> list[int]:
    """The lengths the host knows without reading the device.

    In draft steps 2..k of the padded drafter batch the exact lengths
    depend on how many drafts the device accepted; reading them would block
    the host on the target's forward and the sampler in every such step
    (the NPU's fused attention takes its lengths on the host, and its TND
    layout takes no mask but the causal one). The host keeps
    ``seq_lens_cpu`` as an upper bound instead (patch 0008: the target's
    length plus the draft steps, inside max_model_len), as vllm-ascend does:
    where drafts were rejected the draft attends to their stale KV too,
    which may lower acceptance but never changes the output (the target
    verifies every draft).
    """
    return metadata.seq_lens_list


draft_host_seq_lens = (_draft_seq_lens_known_on_host
                       if npu_kernels() else _draft_seq_lens_from_tensor)


class AscendAttentionImpl(AttentionImpl[AscendAttentionMetadata]):

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: Optional[int] = None,
        alibi_slopes: Optional[list[float]] = None,
        sliding_window: Optional[int] = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: Optional[float] = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: Optional[str] = None,
        **kwargs,
    ) -> None:
        unsupported = {
            "alibi_slopes": alibi_slopes,
            "sliding_window": sliding_window,
            "logits_soft_cap": logits_soft_cap,
        }
        used = [name for name, value in unsupported.items() if value]
        if used:
            raise NotImplementedError(
                f"The Ascend attention backend does not support {used}.")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(
                f"The Ascend attention backend supports decoder attention "
                f"only, not {attn_type}.")
        if kv_cache_dtype != "auto":
            raise NotImplementedError(
                f"kv_cache_dtype={kv_cache_dtype!r} is not supported by the "
                "Ascend attention backend; use the model dtype (auto).")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.ops = get_paged_attention_ops()

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AscendAttentionMetadata,
        output: Optional[torch.Tensor] = None,
        output_scale: Optional[torch.Tensor] = None,
        output_block_scale: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        assert output is not None, "the Ascend backend writes into output"
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError(
                "fused output quantization is not supported by the Ascend "
                "attention backend")
        if attn_metadata is None:
            # Profiling run: no KV cache yet.
            return output
        n = attn_metadata.num_actual_tokens
        key_cache, value_cache = kv_cache.unbind(0)
        if self.kv_sharing_target_layer_name is None:
            self.ops.write_kv_cache(key[:n], value[:n], key_cache,
                                    value_cache, attn_metadata.slot_mapping)
        if graph_tasks.capturing_tasks():
            graph_tasks.launch_task(layer.layer_name, self.ops, query[:n],
                                        key_cache, value_cache, attn_metadata,
                                        self.scale, output[:n])
        else:
            self.ops.attention(query[:n], key_cache, value_cache,
                               attn_metadata, self.scale, output[:n])
        return output
