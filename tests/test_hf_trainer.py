"""A protected transformers model trained by transformers' own ``Trainer`` (the usual training
loop: its data loader, optimizer, scheduler, gradient clipping and logging) takes the steps an
unprotected one takes: the same logged losses and final weights within float32 rounding, every
step checked."""
import copy

import pytest

from hf_models import torch, transformers  # noqa: F401  (skips this module without them)

from attention.hf_linear import projection_cores  # noqa: E402
from attention.hf_protect import attention_cores  # noqa: E402
from attention.torch import protect  # noqa: E402
from hf_models import VOCAB, build  # noqa: E402

pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")

STEPS = 4


class Tokens(torch.utils.data.Dataset):
    """16 sequences of 12 random token ids, their own labels (a causal LM's)."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        ids = torch.randint(3, VOCAB, (12,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def train(model, out_dir):
    args = transformers.TrainingArguments(
        output_dir=str(out_dir), per_device_train_batch_size=4, max_steps=STEPS,
        learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
        seed=0, dataloader_num_workers=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens())
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_trainer_takes_the_same_steps(tmp_path):
    base = build("llama")
    eager = copy.deepcopy(base)
    want = train(eager, tmp_path / "eager")
    model = protect(copy.deepcopy(base), mlp=True)
    got = train(model, tmp_path / "protected")
    assert len(got) == len(want) == STEPS
    assert got == pytest.approx(want, rel=1e-5)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert torch.allclose(p, q, rtol=1e-4, atol=1e-6), name
    assert all(c.last_report.checked and not c.last_report.events
               for c in [*attention_cores(model).values(), *projection_cores(model).values()])
