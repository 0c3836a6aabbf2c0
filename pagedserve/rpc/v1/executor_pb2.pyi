from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BlockPair(_message.Message):
    __slots__ = ("src", "dst")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    src: int
    dst: int
    def __init__(self, src: _Optional[int] = ..., dst: _Optional[int] = ...) -> None: ...

class InitCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InitCacheResponse(_message.Message):
    __slots__ = ("model", "vocab_size", "max_model_len", "eos_token_id", "block_size", "num_gpu_blocks", "num_cpu_blocks", "instance_id", "sliding_window", "protocol")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_GPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    model: str
    vocab_size: int
    max_model_len: int
    eos_token_id: int
    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    instance_id: str
    sliding_window: int
    protocol: int
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., eos_token_id: _Optional[int] = ..., block_size: _Optional[int] = ..., num_gpu_blocks: _Optional[int] = ..., num_cpu_blocks: _Optional[int] = ..., instance_id: _Optional[str] = ..., sliding_window: _Optional[int] = ..., protocol: _Optional[int] = ...) -> None: ...

class SamplingParameters(_message.Message):
    __slots__ = ("n", "best_of", "use_beam_search", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "max_tokens", "ignore_eos", "stop_token_ids", "seed", "logprobs", "length_penalty", "prompt_logprobs", "grammar")
    N_FIELD_NUMBER: _ClassVar[int]
    BEST_OF_FIELD_NUMBER: _ClassVar[int]
    USE_BEAM_SEARCH_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    n: int
    best_of: int
    use_beam_search: bool
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    max_tokens: int
    ignore_eos: bool
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    logprobs: int
    length_penalty: float
    prompt_logprobs: int
    grammar: Grammar
    def __init__(self, n: _Optional[int] = ..., best_of: _Optional[int] = ..., use_beam_search: _Optional[bool] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., max_tokens: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ..., logprobs: _Optional[int] = ..., length_penalty: _Optional[float] = ..., prompt_logprobs: _Optional[int] = ..., grammar: _Optional[_Union[Grammar, _Mapping]] = ...) -> None: ...

class Grammar(_message.Message):
    __slots__ = ("kind", "spec")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    kind: str
    spec: str
    def __init__(self, kind: _Optional[str] = ..., spec: _Optional[str] = ...) -> None: ...

class SequenceStep(_message.Message):
    __slots__ = ("seq_id", "new_token_ids", "num_computed_tokens", "block_table", "sampling_params_index", "num_samples", "sample_index", "prompt_token_ids", "output_token_ids", "num_steps", "follows", "table_start")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    FOLLOWS_FIELD_NUMBER: _ClassVar[int]
    TABLE_START_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    block_table: _containers.RepeatedScalarFieldContainer[int]
    sampling_params_index: int
    num_samples: int
    sample_index: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_steps: int
    follows: bool
    table_start: int
    def __init__(self, seq_id: _Optional[int] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., block_table: _Optional[_Iterable[int]] = ..., sampling_params_index: _Optional[int] = ..., num_samples: _Optional[int] = ..., sample_index: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., num_steps: _Optional[int] = ..., follows: _Optional[bool] = ..., table_start: _Optional[int] = ...) -> None: ...

class ExecuteRequest(_message.Message):
    __slots__ = ("step_id", "epoch", "seqs", "blocks_to_swap_out", "blocks_to_swap_in", "blocks_to_copy", "follows_step_id", "sampling_params", "followers")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TO_SWAP_OUT_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TO_SWAP_IN_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TO_COPY_FIELD_NUMBER: _ClassVar[int]
    FOLLOWS_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    FOLLOWERS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    epoch: int
    seqs: _containers.RepeatedCompositeFieldContainer[SequenceStep]
    blocks_to_swap_out: _containers.RepeatedCompositeFieldContainer[BlockPair]
    blocks_to_swap_in: _containers.RepeatedCompositeFieldContainer[BlockPair]
    blocks_to_copy: _containers.RepeatedCompositeFieldContainer[BlockPair]
    follows_step_id: int
    sampling_params: _containers.RepeatedCompositeFieldContainer[SamplingParameters]
    followers: FollowerColumns
    def __init__(self, step_id: _Optional[int] = ..., epoch: _Optional[int] = ..., seqs: _Optional[_Iterable[_Union[SequenceStep, _Mapping]]] = ..., blocks_to_swap_out: _Optional[_Iterable[_Union[BlockPair, _Mapping]]] = ..., blocks_to_swap_in: _Optional[_Iterable[_Union[BlockPair, _Mapping]]] = ..., blocks_to_copy: _Optional[_Iterable[_Union[BlockPair, _Mapping]]] = ..., follows_step_id: _Optional[int] = ..., sampling_params: _Optional[_Iterable[_Union[SamplingParameters, _Mapping]]] = ..., followers: _Optional[_Union[FollowerColumns, _Mapping]] = ...) -> None: ...

class FollowerColumns(_message.Message):
    __slots__ = ("seq_ids", "sampling_params_index", "sample_index", "num_steps", "table_start", "table_lengths", "table_entries")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_INDEX_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    TABLE_START_FIELD_NUMBER: _ClassVar[int]
    TABLE_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    TABLE_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params_index: _containers.RepeatedScalarFieldContainer[int]
    sample_index: _containers.RepeatedScalarFieldContainer[int]
    num_steps: _containers.RepeatedScalarFieldContainer[int]
    table_start: _containers.RepeatedScalarFieldContainer[int]
    table_lengths: _containers.RepeatedScalarFieldContainer[int]
    table_entries: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., sampling_params_index: _Optional[_Iterable[int]] = ..., sample_index: _Optional[_Iterable[int]] = ..., num_steps: _Optional[_Iterable[int]] = ..., table_start: _Optional[_Iterable[int]] = ..., table_lengths: _Optional[_Iterable[int]] = ..., table_entries: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, entries: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class PromptLogprob(_message.Message):
    __slots__ = ("logprob", "rank", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    rank: int
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, logprob: _Optional[float] = ..., rank: _Optional[int] = ..., top_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class SequenceOutput(_message.Message):
    __slots__ = ("seq_id", "token_ids", "logprobs", "top_logprobs", "prompt_logprobs", "error")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprob]
    error: str
    def __init__(self, seq_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprob, _Mapping]]] = ..., error: _Optional[str] = ...) -> None: ...

class ExecuteResponse(_message.Message):
    __slots__ = ("step_id", "outputs", "drawn")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    DRAWN_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    outputs: _containers.RepeatedCompositeFieldContainer[SequenceOutput]
    drawn: DrawnColumns
    def __init__(self, step_id: _Optional[int] = ..., outputs: _Optional[_Iterable[_Union[SequenceOutput, _Mapping]]] = ..., drawn: _Optional[_Union[DrawnColumns, _Mapping]] = ...) -> None: ...

class DrawnColumns(_message.Message):
    __slots__ = ("seq_ids", "counts", "token_ids", "logprobs")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    counts: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., counts: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class EndStepsRequest(_message.Message):
    __slots__ = ("step_id",)
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    def __init__(self, step_id: _Optional[int] = ...) -> None: ...

class EndStepsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FenceRequest(_message.Message):
    __slots__ = ("epoch",)
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    def __init__(self, epoch: _Optional[int] = ...) -> None: ...

class FenceResponse(_message.Message):
    __slots__ = ("last_step_id",)
    LAST_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    last_step_id: int
    def __init__(self, last_step_id: _Optional[int] = ...) -> None: ...

class CopyBlocksRequest(_message.Message):
    __slots__ = ("blocks_to_copy",)
    BLOCKS_TO_COPY_FIELD_NUMBER: _ClassVar[int]
    blocks_to_copy: _containers.RepeatedCompositeFieldContainer[BlockPair]
    def __init__(self, blocks_to_copy: _Optional[_Iterable[_Union[BlockPair, _Mapping]]] = ...) -> None: ...

class CopyBlocksResponse(_message.Message):
    __slots__ = ("num_copied",)
    NUM_COPIED_FIELD_NUMBER: _ClassVar[int]
    num_copied: int
    def __init__(self, num_copied: _Optional[int] = ...) -> None: ...

class SwapBlocksRequest(_message.Message):
    __slots__ = ("blocks_to_swap_out", "blocks_to_swap_in")
    BLOCKS_TO_SWAP_OUT_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TO_SWAP_IN_FIELD_NUMBER: _ClassVar[int]
    blocks_to_swap_out: _containers.RepeatedCompositeFieldContainer[BlockPair]
    blocks_to_swap_in: _containers.RepeatedCompositeFieldContainer[BlockPair]
    def __init__(self, blocks_to_swap_out: _Optional[_Iterable[_Union[BlockPair, _Mapping]]] = ..., blocks_to_swap_in: _Optional[_Iterable[_Union[BlockPair, _Mapping]]] = ...) -> None: ...

class SwapBlocksResponse(_message.Message):
    __slots__ = ("num_swapped_out", "num_swapped_in")
    NUM_SWAPPED_OUT_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAPPED_IN_FIELD_NUMBER: _ClassVar[int]
    num_swapped_out: int
    num_swapped_in: int
    def __init__(self, num_swapped_out: _Optional[int] = ..., num_swapped_in: _Optional[int] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("instance_id", "ready", "block_size", "num_gpu_blocks", "num_cpu_blocks", "num_steps", "num_replayed_steps", "last_step_id", "epoch", "last_step_seconds", "total_step_seconds", "num_blocks_swapped_out", "num_blocks_swapped_in", "num_blocks_copied", "total_overhead_seconds", "total_read_seconds")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_GPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_REPLAYED_STEPS_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_SWAPPED_OUT_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_SWAPPED_IN_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_COPIED_FIELD_NUMBER: _ClassVar[int]
    TOTAL_OVERHEAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_READ_SECONDS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    ready: bool
    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    num_steps: int
    num_replayed_steps: int
    last_step_id: int
    epoch: int
    last_step_seconds: float
    total_step_seconds: float
    num_blocks_swapped_out: int
    num_blocks_swapped_in: int
    num_blocks_copied: int
    total_overhead_seconds: float
    total_read_seconds: float
    def __init__(self, instance_id: _Optional[str] = ..., ready: _Optional[bool] = ..., block_size: _Optional[int] = ..., num_gpu_blocks: _Optional[int] = ..., num_cpu_blocks: _Optional[int] = ..., num_steps: _Optional[int] = ..., num_replayed_steps: _Optional[int] = ..., last_step_id: _Optional[int] = ..., epoch: _Optional[int] = ..., last_step_seconds: _Optional[float] = ..., total_step_seconds: _Optional[float] = ..., num_blocks_swapped_out: _Optional[int] = ..., num_blocks_swapped_in: _Optional[int] = ..., num_blocks_copied: _Optional[int] = ..., total_overhead_seconds: _Optional[float] = ..., total_read_seconds: _Optional[float] = ...) -> None: ...
