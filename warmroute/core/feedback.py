"""Engine feedback: how many prompt tokens the engine says it had cached, against what the index predicted.

The engine reports cached tokens (`usage.prompt_tokens_details.cached_tokens`, llama.cpp's `timings.cache_n`)
in its own tokens; the index predicts whole blocks of the router's routing key. So the report is converted
to the share of the prompt it covers, then to router blocks, and compared with a tolerance (`tolerance_blocks`):
vLLM never counts the last prompt token as cached, engines round down to their own block size, and a prompt's
parts tokenize at different rates, so the whole prompt's ratio misplaces a cached prefix's end a little.

Pure values in, a verdict out; `Fleet.feedback` applies it to the index.
"""

from __future__ import annotations

from dataclasses import dataclass

CONFIRMED = "confirmed"  # the engine had about what the index predicted
OVERPREDICTED = "overpredicted"  # the index predicted blocks the engine no longer had
UNDERPREDICTED = "underpredicted"  # the engine had blocks the index had forgotten
VERDICTS = (CONFIRMED, OVERPREDICTED, UNDERPREDICTED)
TOLERANCE_BLOCKS = 1
ENGINE_BLOCK_TOKENS = 32  # the engine's rounding, in its tokens: vLLM's GPU default is 16, its CPU backend 32+
RATIO_SLACK = 0.05  # share of the predicted match lost to converting by the whole prompt's token ratio
# The router's capacity figures (kv_capacity_tokens) are scaled by one learnt factor. A misconfiguration is
# usually one number for the whole fleet (the default capacity, or the KV bytes per token behind it), and
# wrong predictions are rare events, so every instance's reports train the one factor. It moves by a relative
# step on each wrong prediction; the step grows while errors point the same way and halves when they turn
# (Rprop), so a 4x error is undone within a few dozen reports and the factor then settles where over- and
# underpredictions balance. Measured in docs/feedback.md.
STEP_INITIAL, STEP_MIN, STEP_MAX = 0.02, 0.005, 0.1
STEP_GROWTH, STEP_DECAY = 1.25, 0.5
SCALE_MIN, SCALE_MAX = 1 / 1024, 64.0  # bounds against runaway (an engine with prefix caching off)


@dataclass(frozen=True)
class Verdict:
    kind: str
    predicted_blocks: int
    reported_blocks: int


def reported_blocks(cached_tokens: int, engine_prompt_tokens: int | None, prompt_tokens: int,
                    block_tokens: int, chain_blocks: int) -> int:
    """The engine's cached tokens as whole router blocks of the chain.

    The engine's tokenizer is not the router's estimate (about 4 bytes a token), so the report is scaled by
    the prompt lengths the two count; without the engine's prompt length, the tokens are taken as the router's.
    """
    if engine_prompt_tokens:
        cached_tokens = cached_tokens * prompt_tokens / engine_prompt_tokens
    return max(0, min(chain_blocks, int(cached_tokens // block_tokens)))


def tolerance_blocks(predicted_blocks: int, engine_prompt_tokens: int | None, prompt_tokens: int,
                     block_tokens: int) -> int:
    """How far a report may fall from the prediction and still confirm it: one router block, one engine block
    (in router blocks) and a share of the prediction, so that reports from an engine with a real tokenizer do not
    judge correct predictions wrong and shrink an index that is right (docs/feedback.md)."""
    ratio = prompt_tokens / engine_prompt_tokens if engine_prompt_tokens else 1.0
    engine_block = -(-ENGINE_BLOCK_TOKENS * ratio // block_tokens)
    return TOLERANCE_BLOCKS + int(engine_block) + int(RATIO_SLACK * predicted_blocks)


def judge(predicted_blocks: int, reported: int, tolerance: int = TOLERANCE_BLOCKS) -> Verdict:
    if reported < predicted_blocks - tolerance:
        return Verdict(OVERPREDICTED, predicted_blocks, reported)
    if reported > predicted_blocks + tolerance:
        return Verdict(UNDERPREDICTED, predicted_blocks, reported)
    return Verdict(CONFIRMED, predicted_blocks, reported)


@dataclass
class CapacityScale:
    """The factor between the configured KV capacities and the caches the engines' reports reveal."""

    value: float = 1.0
    step: float = STEP_INITIAL
    _direction: int = 0  # +1 growing, -1 shrinking, 0 not yet moved

    def update(self, verdict: Verdict) -> bool:
        """Move the factor after a verdict; True if it changed."""
        direction = {OVERPREDICTED: -1, UNDERPREDICTED: 1}.get(verdict.kind, 0)
        if not direction:
            return False
        if direction == self._direction:
            self.step = min(STEP_MAX, self.step * STEP_GROWTH)
        elif self._direction:
            self.step = max(STEP_MIN, self.step * STEP_DECAY)
        self._direction = direction
        before = self.value
        self.value = min(SCALE_MAX, max(SCALE_MIN, self.value * (1 + self.step) ** direction))
        return self.value != before
