"""`data.*`: the datasets and the batch geometry, as `PromptDataset` and the trainer read them (verl's names)."""
from __future__ import annotations

from dataclasses import dataclass, field

from megatron_cpo.config_checks import ConfigError, check, check_choice
from megatron_cpo.data.hint_keys import DEFAULT_HINT_KEYS, check_hint_keys

TRUNCATION_MODES = ("error", "left", "right")
DEFAULT_INSTRUCTION = (
    "Please refer to the above solution to derive your answer, reason step by step, and put your final answer "
    "within \\boxed{}."
)


@dataclass
class DataConfig:
    """Datasets (verl parquet schema) and batch geometry. `train_batch_size` is in prompts: a step trains on exactly
    `train_batch_size * rollout.n` responses. `train_files` / `val_files`: parquet paths (`a`, `a,b` or `[a,b]`);
    `prompt_key`: the chat-messages column; prompts over `max_prompt_length` are dropped (`filter_overlong_prompts`)
    or cut (`truncation: left|right`; `error` names the row). `hint_key` / `hint_instruction`: CPO's hint source and
    second-turn instruction (docs/data.md, docs/cpo.md). `gen_batch_size` (verl's DAPO): prompts per generation batch
    (0: `train_batch_size`). `val_max_samples`: validate on the first this many rows (-1: all).
    """
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    train_batch_size: int = 8
    max_prompt_length: int = 128
    max_response_length: int = 32
    shuffle: bool = True
    val_max_samples: int = -1
    hint_key: list[str] = field(default_factory=lambda: list(DEFAULT_HINT_KEYS))
    hint_instruction: str = DEFAULT_INSTRUCTION
    prompt_key: str = "prompt"
    truncation: str = "error"
    filter_overlong_prompts: bool = False
    gen_batch_size: int = 0

    def __post_init__(self) -> None:
        self.train_files = [f for entry in self.train_files for f in str(entry).split(",") if f]
        self.val_files = [f for entry in self.val_files for f in str(entry).split(",") if f]
        check_choice("data.truncation", self.truncation, TRUNCATION_MODES)
        check(self.gen_batch_size == 0 or self.gen_batch_size >= self.train_batch_size,
              f"data.gen_batch_size={self.gen_batch_size} is below data.train_batch_size={self.train_batch_size}; "
              "raise it (verl's DAPO uses 3 x train_batch_size) or set 0")
        check(self.train_batch_size >= 1, f"data.train_batch_size={self.train_batch_size} must be >= 1")
        check(self.val_max_samples == -1 or self.val_max_samples >= 1, f"data.val_max_samples="
              f"{self.val_max_samples} must be >= 1, or -1 to validate on every row of data.val_files")
        try:
            check_hint_keys(self.hint_key)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        check(self.max_prompt_length >= 1, f"data.max_prompt_length={self.max_prompt_length} must be >= 1")
        check(self.max_response_length >= 1, f"data.max_response_length={self.max_response_length} must be >= 1")

    @property
    def generation_batch_size(self) -> int:
        """Prompts per generation batch, the unit of `algorithm.filter_groups.max_num_gen_batches`."""
        return self.gen_batch_size or self.train_batch_size
