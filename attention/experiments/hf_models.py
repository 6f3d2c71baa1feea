"""Small Hugging Face transformers models of the seed paper's four families and of Llama, built
in code.

BERT, RoBERTa (masked language models), GPT-2, GPT-Neo and Llama (causal language models; Llama
has the architecture most models trained today share: rotary positions, grouped-query attention,
RMSNorm, a gated feed-forward layer, no biases), each from a config with random initialization;
nothing is downloaded. :class:`HFTrainer` trains one on the
synthetic corpus of :mod:`attention.experiments.train` (characters as token ids) with the
interface the training runs use there (``batch``, ``grads``, ``finite``, ``opt``), so
``abft train --model gpt2`` runs the same four runs (fault-free, unprotected, protected,
checkpoint/restore) as the built-in NumPy GPT.

Protection: the model is protected once (:func:`attention.torch.protect`); a run's check mode is
set on every protected module (``check="off"`` keeps the hooks, so faults still reach the
products, but checks nothing). Faults are injected through :func:`attention.torch.fault_hook`;
their sites are the protected products' full names (``"transformer.h.0.attn:scores"``).
"""
from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any

import numpy as np

from abftgemm.report import Report

FAMILIES: tuple[str, ...] = ("bert", "roberta", "gpt2", "gpt-neo", "llama")
#: Families trained as masked language models (the others as causal language models).
MASKED_LM = ("bert", "roberta")
#: Share of the positions a masked language model predicts per batch.
MASK_SHARE = 0.15
#: Seeds :func:`build` takes are below this (``torch.manual_seed`` refuses larger ones).
SEED_LIMIT = 2 ** 64


def model_problem(model: str, d_model: int, n_heads: int, seed: int) -> str | None:
    """Why ``--model model`` cannot be built with these flags, or None (always None for a model
    that is not one of :data:`FAMILIES`): Llama's rotary positions turn pairs of a head's
    columns (an odd width fails in its first step), and ``torch.manual_seed`` refuses seeds from
    :data:`SEED_LIMIT` on."""
    if model not in FAMILIES:
        return None
    width = d_model // n_heads
    if model == "llama" and width % 2:
        return (f"--model llama turns pairs of a head's columns: --d-model / --heads must be "
                f"even, got {d_model} / {n_heads} = {width}")
    if seed >= SEED_LIMIT:
        return f"--seed of --model {model} must be below 2**64 (torch's seeds), got {seed}"
    return None


def build(family: str, *, vocab: int, seq: int, d_model: int, n_heads: int, n_layers: int,
          d_ff: int, seed: int, attn_implementation: str = "eager", dropout: float = 0.0) -> Any:
    """A ``family`` model with random weights from ``seed``, in training mode.

    Parameters
    ----------
    family : {"bert", "roberta", "gpt2", "gpt-neo", "llama"}
    vocab, seq, d_model, n_heads, n_layers, d_ff : int
        Vocabulary (a masked LM adds one id for its mask token), longest sequence, sizes (Llama
        gets ``n_heads // 2`` key and value heads where ``n_heads`` is even).
    seed : int
        ``torch.manual_seed`` before the weights are drawn.
    attn_implementation : str
        transformers' attention implementation ("eager", "sdpa", or "abft" once
        :mod:`attention.hf` is imported).
    dropout : float
        Attention dropout probability (hidden and embedding dropout are 0).
    """
    import torch
    import transformers as t

    if family not in FAMILIES:
        raise ValueError(f"model family must be one of {FAMILIES}, got {family!r}")
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab + (family in MASKED_LM), attn_implementation=attn_implementation)
    if family in MASKED_LM:
        config_class, model_class = ((t.BertConfig, t.BertForMaskedLM) if family == "bert" else
                                     (t.RobertaConfig, t.RobertaForMaskedLM))
        # RoBERTa's positions start after its padding id: room for them
        config = config_class(**common, hidden_size=d_model, num_hidden_layers=n_layers,
                              num_attention_heads=n_heads, intermediate_size=d_ff,
                              max_position_embeddings=seq + 4, attention_probs_dropout_prob=dropout,
                              hidden_dropout_prob=0.0, pad_token_id=1)
    elif family == "gpt2":
        config = t.GPT2Config(**common, n_embd=d_model, n_layer=n_layers, n_head=n_heads,
                              n_inner=d_ff, n_positions=seq, attn_pdrop=dropout, resid_pdrop=0.0,
                              embd_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    elif family == "llama":
        config = t.LlamaConfig(**common, hidden_size=d_model, num_hidden_layers=n_layers,
                               num_attention_heads=n_heads,
                               num_key_value_heads=n_heads // 2 if n_heads % 2 == 0 else n_heads,
                               intermediate_size=d_ff, max_position_embeddings=seq,
                               attention_dropout=dropout, bos_token_id=0, eos_token_id=0)
    else:
        config = t.GPTNeoConfig(**common, hidden_size=d_model, num_layers=n_layers,
                                num_heads=n_heads, intermediate_size=d_ff,
                                attention_types=[[["global", "local"], max(1, n_layers // 2)]]
                                if n_layers % 2 == 0 else [[["global"], n_layers]],
                                window_size=max(2, seq // 2), max_position_embeddings=seq,
                                attention_dropout=dropout, resid_dropout=0.0, embed_dropout=0.0,
                                bos_token_id=0, eos_token_id=0)
    causal_lm = {"gpt2": t.GPT2LMHeadModel, "gpt-neo": t.GPTNeoForCausalLM,
                 "llama": t.LlamaForCausalLM}
    model = model_class(config) if family in MASKED_LM else causal_lm[family](config)
    model.train()
    return model


def loss_of(model: Any, family: str, tokens: Any, step_seed: int, vocab: int) -> Any:
    """The training loss of one batch ``tokens`` ``(batch, seq)`` (int64 tensor): next-token
    cross-entropy for causal models; for masked models, cross-entropy at
    :data:`MASK_SHARE` of the positions (drawn from ``step_seed``), replaced by the mask id
    ``vocab``."""
    import torch

    if family not in MASKED_LM:
        return model(tokens, labels=tokens).loss
    rng = np.random.default_rng(step_seed)
    chosen = torch.from_numpy(rng.random(tuple(tokens.shape)) < MASK_SHARE)
    chosen[:, 0] |= ~chosen.any(dim=1)  # at least one position per sequence
    inputs = tokens.masked_fill(chosen, vocab)
    labels = tokens.masked_fill(~chosen, -100)
    return model(inputs, labels=labels).loss


def set_check(model: Any, check: str) -> None:
    """Set the check mode of every protected module of ``model`` (attention and projections)."""
    from attention.torch import protected_cores

    for core in protected_cores(model).values():
        core.check = check


def reports(model: Any) -> Report:
    """The last reports of every protected module of ``model``, merged."""
    from attention.torch import protected_cores

    merged = Report()
    for core in protected_cores(model).values():
        merged.extend(core.last_report)
    return merged


class TorchAdam:
    """``torch.optim.AdamW`` behind the interface of :class:`attention.experiments.train.Adam`:
    ``step(grads)`` (the gradients are the parameters' ``.grad``), ``save``/``load`` of the model
    and optimizer state."""

    def __init__(self, model: Any, lr: float):
        import torch

        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99),
                                           weight_decay=0.0)

    def step(self, grads: Any) -> None:
        del grads  # in the parameters' .grad
        self.optimizer.step()

    def save(self, path: Path, xp: Any) -> None:
        import torch

        torch.save({"model": self.model.state_dict(), "opt": self.optimizer.state_dict()}, path)

    def load(self, path: Path, xp: Any) -> None:
        import torch

        state = torch.load(path, weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["opt"])


class HFTrainer:
    """Model, optimizer and batches of one training run of a transformers model.

    Parameters
    ----------
    config : attention.experiments.train.TrainConfig
        Sizes, learning rate, seed; ``config.model`` names the family.
    data : int array
        The corpus as token ids.
    vocab : int
        Number of distinct token ids in ``data``.
    device : str
        ``"cpu"`` or ``"cuda"``.
    """

    def __init__(self, config: Any, data: np.ndarray, vocab: int, device: str = "cpu"):
        from attention.torch import protect

        self.config, self.data, self.vocab, self.device = config, data, vocab, device
        self.xp = np  # checkpoints hold torch state; no array module involved
        self.checkpoint_name = "checkpoint.pt"
        model = build(config.model, vocab=vocab, seq=config.seq, d_model=config.d_model,
                      n_heads=config.n_heads, n_layers=config.n_layers, d_ff=config.d_ff,
                      seed=config.seed)
        self.model = protect(model.to(device))
        self.opt = TorchAdam(self.model, config.lr)

    def batch(self, step: int) -> Any:
        """Token ids of ``step`` (the same in every run and on replay)."""
        import torch

        cfg = self.config
        rng = np.random.default_rng([cfg.seed, 4, step])
        starts = rng.integers(len(self.data) - cfg.seq, size=cfg.batch)
        window = self.data[starts[:, None] + np.arange(cfg.seq)]
        return torch.from_numpy(window).to(self.device)

    def grads(self, step: int, check: str, fault: Any | None, result: Any) -> tuple[float, None]:
        """Loss of ``step`` (its gradients in the parameters' ``.grad``), recording what
        protection and the fault did."""
        from attention.torch import fault_hook

        set_check(self.model, check)
        self.model.zero_grad(set_to_none=True)
        hook = fault.hook() if fault else None
        tokens = self.batch(step)
        with fault_hook(self.model, hook) if hook else contextlib.nullcontext():
            loss = loss_of(self.model, self.config.model, tokens,
                           self.config.seed * 1_000_003 + step, self.vocab)
            loss.backward()
        report = reports(self.model)
        result.faults_injected += bool(hook and hook.injected)
        result.detected += report.detected
        result.corrected += report.corrected
        result.recomputed += report.recomputed
        return float(loss.detach()), None

    def finite(self, loss: float, grads: Any) -> bool:
        """Whether the loss and every gradient are finite."""
        import torch

        return math.isfinite(loss) and all(bool(torch.isfinite(p.grad).all())
                                           for p in self.model.parameters() if p.grad is not None)

    def weights_finite(self) -> bool:
        """Whether every weight is finite."""
        import torch

        return all(bool(torch.isfinite(p).all()) for p in self.model.parameters())

    def sites(self) -> list[str]:
        """The full names of every protected product one training step runs, in call order."""
        from abftgemm.faults import Recorder
        from attention.torch import fault_hook

        recorder = Recorder()
        self.model.zero_grad(set_to_none=True)
        with fault_hook(self.model, recorder):
            loss_of(self.model, self.config.model, self.batch(0), 0, self.vocab).backward()
        self.model.zero_grad(set_to_none=True)
        return list(dict.fromkeys(call.site for call in recorder.calls))
