"""What an emulated SGLang server is built from: its speed profile, its mode and its fault knobs."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from policies.adaptive import DepthModel, check_adaptable
from policies.base import Pool
from policies.ladder import SGLANG_DEFAULT, Ladder, LadderError, parse_ladder
from policies.prefix import DEFAULT_CACHE_TOKENS
from policies.profile import Profile
from simulator.emulator.accept_rules import AcceptRules

DEFAULT_MAX_RUNNING = {"baseline": 256, "eagle": 48}


class FaultConfig(BaseModel):
    """Fault knobs; live-tunable (assignments are validated) through `EmulatorServer.faults`."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    error_rate: float = Field(
        default=0.0, ge=0, le=1, description="Fraction of generation requests answered 500."
    )
    max_queued_requests: int | None = Field(
        default=None, ge=0, description="Waiting-queue bound: beyond it 503 (streaming: 200 + error event)."
    )
    stall_s: float = Field(
        default=0.0, ge=0, description="Wall seconds to wait before answering a generation."
    )
    die_after_chunks: int | None = Field(
        default=None, ge=0, description="Drop the connection after this many content chunks (no [DONE])."
    )
    refuse_connections: bool = Field(default=False, description="Close every connection without an answer.")
    unhealthy: bool = Field(default=False, description="/health and /ready answer 503.")


class EmulatorConfig(BaseModel):
    """Everything an emulated server is built from (frozen; faults are copied and live)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Pool = Field(description="baseline (plain decoding) or eagle (EAGLE-3 speculative decoding).")
    profile: Profile = Field(description="Speed profile; the `mode` entry sets the timing.")
    model: str = Field(default="specroute-emulated", description="Served model name (/v1/models, metrics).")
    time_scale: float = Field(default=1.0, gt=0, description="Wall seconds per profile second.")
    max_running_requests: int | None = Field(default=None, ge=1, description="Override the profile's cap.")
    accept_length: float | None = Field(
        default=None, ge=1, description="Override the profile's accept_length."
    )
    speculative_num_steps: int = Field(
        default=3,
        ge=1,
        le=16,
        description="Draft steps per verify (eagle); with speculative_adaptive, the depth each "
        "batch-size bucket starts at (one of the ladder's steps, as SGLang requires).",
    )
    speculative_adaptive: bool = Field(
        default=False,
        description="SGLang's --speculative-adaptive (eagle): the draft depth of every step follows "
        "the decode batch size (SGLang's default ladder: batch >= 1 -> 1/3/5/7 steps, >= 8 -> 0/1/3, "
        ">= 32 -> 0/1, >= 64 -> 0, each bucket's EMA of accepted drafts choosing), and the speed with "
        "it (the plain mode's at 0 steps; policies/adaptive.py). Needs both modes in the profile. "
        "Mind --max-running-requests: SGLang caps a speculative server at 48.",
    )
    speculative_adaptive_config: str | None = Field(
        default=None,
        description="SGLang's --speculative-adaptive-config: a JSON file with its ladder (integer-string "
        'batch sizes -> {"candidate_steps": [...]}, optional knobs), or the compact '
        "MIN_BATCH:STEPS[/STEPS...],... form; reported as given on /server_info.",
    )
    hint_factors: dict[str, float] = Field(
        default_factory=dict, description="Acceptance factor per x-specroute-hint value (eagle)."
    )
    accept_rules: AcceptRules = Field(
        default_factory=AcceptRules,
        description="Acceptance factor by prompt text and temperature (eagle; see accept_rules.py).",
    )
    output_tokens_mean: float = Field(
        default=256.0, ge=1, description="Mean natural output length (no max_tokens)."
    )
    output_tokens_cv: float = Field(default=0.5, ge=0, description="Coefficient of variation (lognormal).")
    max_model_len: int = Field(default=262144, ge=16, description="Context length reported and enforced.")
    eos_token_id: int = Field(default=163586, description="Reported as matched_stop when a request stops.")
    stats_interval_steps: int = Field(default=40, ge=1, description="Decode steps between gauge refreshes.")
    api_key: str | None = Field(default=None, description="When set, generation routes need this Bearer key.")
    disable_radix_cache: bool = Field(
        default=False, description="No prefix cache: every prompt token is prefilled (SGLang's flag)."
    )
    cache_tokens: int | None = Field(
        default=None,
        ge=0,
        description=(
            "Prefix cache capacity in tokens (default: the profile mode's cache_tokens, else "
            f"{DEFAULT_CACHE_TOKENS:,})."
        ),
    )
    cache_block_tokens: int = Field(
        default=64,
        ge=1,
        le=4096,
        description="Tokens per cache block (SGLang caches per token; blocks are cheaper).",
    )
    enable_cache_report: bool = Field(
        default=False,
        description="Report usage.prompt_tokens_details.cached_tokens on the OpenAI routes (SGLang's flag).",
    )
    reasoning_tokens: int = Field(
        default=0,
        ge=0,
        description="Chat streams: the first this many output tokens of each answer arrive as "
        "delta.reasoning (vLLM's reasoning field), the rest as delta.content.",
    )
    empty_chunk_every: int = Field(
        default=0,
        ge=0,
        description="Chat and completion streams: every Nth output chunk carries empty text, its "
        "text sent with the next one (as vLLM does while a UTF-8 sequence is incomplete); 0: never.",
    )
    seed: int = Field(default=0, description="Seeds output lengths, acceptance draws and error draws.")
    faults: FaultConfig = Field(default_factory=lambda: FaultConfig())
    _ladder: Ladder | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _check_mode(self) -> EmulatorConfig:
        mode = self.profile.mode(self.mode)  # raises ProfileError naming the modes it has
        if self.mode == "eagle" and self.accept_length is None and mode.accept_length is None:
            raise ValueError("the profile's eagle mode has no accept_length: set accept_length")
        accept = self.accept_length or mode.accept_length
        steps = (mode.speculative_num_steps or 3) if self.speculative_adaptive else self.speculative_num_steps
        if self.mode == "eagle" and accept is not None and accept > steps + 1:
            raise ValueError(
                f"accept_length {accept} is more than a verify step can accept with "
                f"speculative_num_steps={steps} (at most {steps + 1}): raise speculative_num_steps"
                + (" in the profile's eagle mode" if self.speculative_adaptive else "")
            )
        for hint, factor in self.hint_factors.items():
            if not factor > 0:
                raise ValueError(f"hint_factors[{hint!r}] must be > 0, got {factor}")
        self._ladder = self._adaptive_ladder()
        return self

    def _adaptive_ladder(self) -> Ladder | None:
        if self.speculative_adaptive_config is not None and not self.speculative_adaptive:
            raise ValueError("speculative_adaptive_config needs speculative_adaptive")
        if not self.speculative_adaptive:
            return None
        if self.mode != "eagle":
            raise ValueError("speculative_adaptive needs mode eagle")
        check_adaptable(self.profile)
        spec = self.speculative_adaptive_config
        try:
            ladder = SGLANG_DEFAULT if spec is None else parse_ladder(spec)
        except LadderError as e:
            raise ValueError(f"speculative_adaptive_config: {e}") from None
        if ladder is None:
            raise ValueError("speculative_adaptive_config: off is no ladder")
        if self.speculative_num_steps not in ladder.candidates:
            raise ValueError(
                f"speculative_num_steps {self.speculative_num_steps} is not one of the ladder's steps "
                f"{list(ladder.candidates)}: pass one of those"
            )
        return Ladder(ladder.buckets, "sglang", self.speculative_num_steps, origin=ladder.origin)

    @property
    def ladder(self) -> Ladder | None:
        """The adaptive ladder (None: a fixed depth)."""
        return self._ladder

    @property
    def depth(self) -> DepthModel:
        """What the profile's eagle points were measured at, with this server's accept length."""
        eagle = self.profile.mode("eagle")
        if self.accept_length is not None:
            eagle = eagle.model_copy(update={"accept_length": self.accept_length})
        return DepthModel.of(eagle)

    @property
    def effective_max_running(self) -> int:
        mode = self.profile.mode(self.mode)
        return self.max_running_requests or mode.max_running_requests or DEFAULT_MAX_RUNNING[self.mode]

    @property
    def effective_cache_tokens(self) -> int:
        """The prefix cache's capacity in tokens (0 with `disable_radix_cache`)."""
        if self.disable_radix_cache:
            return 0
        if self.cache_tokens is not None:
            return self.cache_tokens
        mode = self.profile.mode(self.mode).cache_tokens
        return mode if mode is not None else DEFAULT_CACHE_TOKENS

    @property
    def effective_accept_length(self) -> float | None:
        if self.mode != "eagle":
            return None
        return self.accept_length or self.profile.mode(self.mode).accept_length
