"""optirs.torch inside the trainers people use: the Hugging Face Trainer (both ways of passing an
optimizer, checkpoint and resume), Lightning (``configure_optimizers``, gradient clipping) and
accelerate (``prepare``, gradient accumulation, its clipping), each against the same run with
``torch.optim.AdamW`` (docs/integrations.md). Tiny randomly initialised models, CPU, no downloads."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
lightning = pytest.importorskip("lightning")

import optirs.torch as ot  # noqa: E402

LR = 1e-2


def _gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2)
    return transformers.GPT2LMHeadModel(config)


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n=16):
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 64, (n, 16), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _hf_train(tmp_path, name, steps, given=None, cls_kwargs=None, resume=None, save_steps=None):
    model = _gpt2()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / name), max_steps=steps, per_device_train_batch_size=4, learning_rate=LR,
        weight_decay=0.01, lr_scheduler_type="linear", warmup_steps=1, max_grad_norm=1.0, logging_strategy="no",
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500, report_to=[], use_cpu=True,
        seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True)
    kwargs = {}
    if given is not None:  # an optimizer made by the user (no scheduler: the Trainer makes its own)
        kwargs["optimizers"] = (given(model.parameters(), lr=LR, weight_decay=0.01), None)
    if cls_kwargs is not None:  # the Trainer makes it, with its own param groups (no decay on biases, norms)
        kwargs["optimizer_cls_and_kwargs"] = (cls_kwargs, {"lr": LR, "weight_decay": 0.01})
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Tokens(), **kwargs)
    trainer.train(resume_from_checkpoint=resume)
    return trainer, [p.detach().clone() for p in model.parameters()]


def _close(got, want):
    """Within float32 rounding of torch's trajectory: Adam's normalised update turns rounding in a
    tiny gradient into up to a few 1e-4 of a step (lr); a wrong decay, clip or schedule moves
    parameters by a good part of a step."""
    assert any(not torch.equal(w, p) for w, p in zip(want, _gpt2().parameters()))  # it trained
    for g, w in zip(got, want):
        assert torch.allclose(g, w, rtol=0, atol=2e-3 * LR), (g - w).abs().max()


def test_hugging_face_trainer_with_optirs_equals_torch(tmp_path):
    trainer, got = _hf_train(tmp_path, "given", 4, given=ot.AdamW)
    opt = trainer.optimizer
    assert isinstance(getattr(opt, "optimizer", opt), ot.AdamW)
    _close(got, _hf_train(tmp_path, "given-torch", 4, given=torch.optim.AdamW)[1])
    _close(_hf_train(tmp_path, "class", 4, cls_kwargs=ot.AdamW)[1],
           _hf_train(tmp_path, "class-torch", 4, cls_kwargs=torch.optim.AdamW)[1])


def test_hugging_face_trainer_resumes_an_optirs_checkpoint_exactly(tmp_path):
    _, whole = _hf_train(tmp_path, "run", 4, cls_kwargs=ot.AdamW, save_steps=2)
    checkpoint = tmp_path / "run" / "checkpoint-2"
    assert (checkpoint / "optimizer.pt").exists()
    _, resumed = _hf_train(tmp_path, "resumed", 4, cls_kwargs=ot.AdamW, resume=str(checkpoint))
    for a, b in zip(whole, resumed):
        assert torch.equal(a, b)


class _Regression(lightning.LightningModule):
    def __init__(self, optimizer_cls):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.optimizer_cls = optimizer_cls

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = self.optimizer_cls(self.parameters(), lr=LR, weight_decay=0.01)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)}


def _lightning_train(optimizer_cls):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 8, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
    loader = torch.utils.data.DataLoader(data, batch_size=16)
    module = _Regression(optimizer_cls)
    trainer = lightning.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=0.5)
    trainer.fit(module, loader)
    return [p.detach().clone() for p in module.parameters()]


def test_lightning_with_optirs_equals_torch():
    ref = _lightning_train(torch.optim.AdamW)
    got = _lightning_train(ot.AdamW)
    assert any(not torch.equal(r, p) for r, p in zip(ref, _Regression(torch.optim.AdamW).parameters()))  # it trained
    for r, g in zip(ref, got):
        assert torch.allclose(g, r, rtol=0, atol=2e-3 * LR), (g - r).abs().max()


def _accelerate_train(optimizer_cls):
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        opt = optimizer_cls(model.parameters(), lr=LR, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        g = torch.Generator().manual_seed(2)
        x = torch.randn(64, 8, generator=g)
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True)),
                                             batch_size=8)
        model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
        steps = 0
        for xb, yb in loader:
            with acc.accumulate(model):
                acc.backward(torch.nn.functional.mse_loss(model(xb), yb))
                if acc.sync_gradients:
                    acc.clip_grad_norm_(model.parameters(), 0.5)
                    steps += 1
                opt.step()
                sched.step()
                opt.zero_grad()
        return steps, [p.detach().clone() for p in acc.unwrap_model(model).parameters()]
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def test_accelerate_with_optirs_equals_torch():
    """accelerate's prepare (its optimizer and scheduler wrappers), gradient accumulation over 2
    micro-batches and its clip_grad_norm_, against the same loop with torch.optim.AdamW."""
    steps, ref = _accelerate_train(torch.optim.AdamW)
    got_steps, got = _accelerate_train(ot.AdamW)
    assert steps == got_steps == 4
    torch.manual_seed(0)
    init = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).parameters()
    assert any(not torch.equal(r, p) for r, p in zip(ref, init))  # it trained
    for r, g in zip(ref, got):
        assert torch.allclose(g, r, rtol=0, atol=2e-3 * LR), (g - r).abs().max()
