"""A step's workspace, shared by the memory models: a layer's temporaries scale with the tokens in
flight, the fp32 logits with the logit rows only (``--max-logit-rows-per-step``)."""

from __future__ import annotations

# Temporaries of one layer's forward, in multiples of a [T, residual width] fp32 tensor.
ACTIVATION_COPIES = 32
# fp32 [rows, vocab] tensors alive at once: the logits and the sampler's (log-)softmax copy.
LOGIT_COPIES = 2


def activation_bytes(tokens_in_flight: int, residual_width: int) -> int:
    """A layer's temporaries for ``tokens_in_flight`` rows of a ``residual_width``-wide stream."""
    return tokens_in_flight * residual_width * 4 * ACTIVATION_COPIES


def logits_bytes(logit_rows: int, vocab_size: int) -> int:
    return logit_rows * vocab_size * 4 * LOGIT_COPIES


class StepWorkspace:
    """The workspace half of a memory model, the same for every architecture: a model defines
    ``vocab_size`` and :meth:`activation_bytes`; the logits and the sum come from here."""

    vocab_size: int

    def activation_bytes(self, tokens_in_flight: int) -> int:
        raise NotImplementedError

    def logits_bytes(self, logit_rows: int) -> int:
        return logits_bytes(logit_rows, self.vocab_size)

    def workspace_bytes(self, tokens_in_flight: int, logit_rows: int) -> int:
        return self.activation_bytes(tokens_in_flight) + self.logits_bytes(logit_rows)


def gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def mib(n: float) -> str:
    return f"{n / (1 << 20):.2f} MiB"
