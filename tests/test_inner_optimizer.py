"""The inner optimizer on the real tiny Megatron model in one process (T = P = D = 1): its AdamW group
is torch.optim.AdamW, its Muon group is torch.optim.Muon (Keller's schedule) and our reference Muon
(the paper's schedule) applied to each logical matrix separately (Q, K, V, gate, up), routing sends
exactly embeddings, the output head and 1-D parameters to AdamW, and clipping uses the global norm."""
import pytest
import torch

from test_muon_math import torch_muon_in_fp32  # noqa: F401  (a fixture: torch's Newton-Schulz in fp32)
from trainer.model.builder import canonical_names
from trainer.model.sharding import from_logical_matrices, logical_matrices
from trainer.model.presets import PRESETS
from trainer.optim.config import OptimizerConfig
from trainer.optim.inner import InnerOptimizer
from trainer.optim.muon import Muon, MuonConfig
from trainer.optim.routing import route_parameters
from muloco.core.typed_json import load
from megatron_world import megatron_world_of_one, tiny_model

SHAPE = PRESETS["tiny"]
STEPS = 2  # the second step exercises the momentum buffers
TOL = dict(rtol=1e-5, atol=1e-6)  # weights ~0.02, one update ~1e-3: a wrong update is far outside


@pytest.fixture(scope="module", autouse=True)
def world():
    with megatron_world_of_one():
        yield


@pytest.fixture
def model():
    return tiny_model()


def _optimizer(type_: str, params: dict) -> OptimizerConfig:
    """The ds_config's optimizer block, as a user writes it, loaded as the trainer loads it."""
    return load(OptimizerConfig, {"type": type_, "params": params}, "optimizer")


def _inner(model, config: OptimizerConfig, clip_grad: float = 0.0):
    """As trainer/run.py builds it, with no process groups (every group of size one)."""
    routing = route_parameters(model.named_parameters(), use_muon=config.type == "muon")
    return InnerOptimizer(routing, canonical_names(model), config, clip_grad, SHAPE, None, None, None), routing


def _random_grads(model, generator) -> dict[str, torch.Tensor]:
    grads = {}
    for name, p in model.named_parameters():
        p.grad = torch.randn(p.shape, generator=generator) * 0.01
        grads[name] = p.grad.clone()
    return grads


class _PerLogicalMatrix:
    """A single-process optimizer applied to each logical matrix of the Muon-routed weights as a
    separate parameter (the paper's model), and AdamW to the rest."""

    def __init__(self, routing, muon_factory, adamw_lr: float, adamw_wd: float):
        self.muon_params = {name: {part: torch.nn.Parameter(m.detach().clone())
                                   for part, m in logical_matrices(name, p, SHAPE).items()}
                            for name, p in routing.muon}
        self.adamw_params = {name: torch.nn.Parameter(p.detach().clone()) for name, p in routing.adamw}
        self.muon = (muon_factory([m for parts in self.muon_params.values() for m in parts.values()])
                     if self.muon_params else None)
        self.adamw = (torch.optim.AdamW(self.adamw_params.values(), lr=adamw_lr, betas=(0.9, 0.99), eps=1e-8,
                                        weight_decay=adamw_wd) if self.adamw_params else None)

    def step(self, grads: dict[str, torch.Tensor]) -> None:
        for name, parts in self.muon_params.items():
            for part, g in logical_matrices(name, grads[name], SHAPE).items():
                parts[part].grad = g.clone()
        for name, p in self.adamw_params.items():
            p.grad = grads[name].clone()
        if self.muon is not None:
            self.muon.step()
        if self.adamw is not None:
            self.adamw.step()

    def weights(self) -> dict[str, torch.Tensor]:
        out = {name: p.detach() for name, p in self.adamw_params.items()}
        out.update({name: from_logical_matrices(name, {k: v.detach() for k, v in parts.items()}, SHAPE)
                    for name, parts in self.muon_params.items()})
        return out


def _train_both(model, config: OptimizerConfig, reference: _PerLogicalMatrix, optimizer) -> None:
    generator = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        reference.step(_random_grads(model, generator))
        optimizer.step()
    expected = reference.weights()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[name], **TOL, msg=lambda m: f"{name}: {m}")


def test_adamw_equals_torch_adamw(model):
    config = _optimizer("adamw", {"lr": 1e-2, "weight_decay": 0.1})
    optimizer, routing = _inner(model, config)
    assert not routing.muon
    _train_both(model, config, _PerLogicalMatrix(routing, None, 1e-2, 0.1), optimizer)


def test_muon_equals_torch_muon_per_logical_matrix(model, torch_muon_in_fp32):  # noqa: F811
    config = _optimizer("muon", {
        "lr": 0.02, "weight_decay": 0.1, "momentum": 0.9, "ns_schedule": "keller", "lr_scaling": "torch_original",
        "adamw_lr_factor": 0.15, "adamw_weight_decay_factor": 0.5})
    optimizer, routing = _inner(model, config)
    reference = _PerLogicalMatrix(
        routing, lambda params: torch.optim.Muon(params, lr=0.02, weight_decay=0.1,
                                                 momentum=0.9, nesterov=False, adjust_lr_fn="original"),
        adamw_lr=0.02 * 0.15, adamw_wd=0.1 * 0.5)
    _train_both(model, config, reference, optimizer)


@pytest.mark.parametrize("extra", [{}, {"momentum_dtype": "bfloat16", "ns_form": "gram"}])
def test_muon_equals_reference_muon_with_paper_schedule(model, extra):
    config = _optimizer("muon", {"lr": 0.02, "weight_decay": 0.1, "nesterov": True, **extra})  # paper schedule
    optimizer, routing = _inner(model, config)
    muon_config = MuonConfig(momentum=0.9, nesterov=True, ns_schedule="paper", lr_scaling="spectral_norm", **extra)
    reference = _PerLogicalMatrix(routing, lambda params: Muon(params, muon_config, lr=0.02, weight_decay=0.1),
                                  adamw_lr=0.02, adamw_wd=0.1)
    _train_both(model, config, reference, optimizer)
    dtype = getattr(torch, extra.get("momentum_dtype", "float32"))
    assert all(optimizer.state[p]["momentum_buffer"].dtype == dtype for _, p in routing.muon)


def test_momentum_saved_in_the_other_dtype_is_taken_as_this_runs(model):
    """A checkpoint written with momentum_dtype float32 resumed with bfloat16 (or back): the buffer
    restored as saved is converted at the next step, the AdamW moments stay fp32."""
    optimizer, routing = _inner(model, _optimizer("muon", {"momentum_dtype": "bfloat16"}))
    _random_grads(model, torch.Generator().manual_seed(1))
    saved = {p: torch.randn(p.shape, generator=torch.Generator().manual_seed(2)) for _, p in routing.muon}
    for p, buffer in saved.items():
        optimizer.state[p]["momentum_buffer"] = buffer.clone()
    optimizer.step()
    for p, buffer in saved.items():
        state = optimizer.state[p]["momentum_buffer"]
        assert state.dtype == torch.bfloat16
        torch.testing.assert_close(state.float(), 0.9 * buffer.to(torch.bfloat16).float() + p.grad, rtol=2 ** -8, atol=0)
    assert all(optimizer.state[p]["exp_avg"].dtype == torch.float32 for _, p in routing.adamw)


def test_routing(model):
    routing = route_parameters(model.named_parameters(), use_muon=True)
    to_adamw = {n for n, p in model.named_parameters()
                if p.dim() == 1 or n in ("embedding.word_embeddings.weight", "output_layer.weight")}
    assert {n for n, _ in routing.adamw} == to_adamw
    assert {n for n, _ in routing.muon} == {n for n, _ in model.named_parameters()} - to_adamw
    assert all(n.endswith(("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight"))
               for n, _ in routing.muon)
    plain = route_parameters(model.named_parameters(), use_muon=False)
    assert not plain.muon and len(plain.adamw) == len(list(model.parameters()))


def test_routing_rejects_uncovered_parameter(model):
    stray = ("decoder.layers.0.mlp.router.weight", torch.nn.Parameter(torch.zeros(4, 8)))  # untagged 2-D
    with pytest.raises(ValueError, match="no optimizer rule covers parameter decoder.layers.0.mlp.router.weight"):
        route_parameters([*model.named_parameters(), stray], use_muon=True)


def test_clipping_uses_the_global_norm(model):
    optimizer, _ = _inner(model, _optimizer("muon", {"lr": 0.02}), clip_grad=1.0)
    grads = _random_grads(model, torch.Generator().manual_seed(1))
    reference = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads.values()]
    for r, g in zip(reference, grads.values()):
        r.grad = g.clone()
    total = torch.nn.utils.clip_grad_norm_(reference, max_norm=1.0)  # torch's global-norm clipping
    assert total > 1.0, "the gradients must be large enough to clip"
    optimizer.step()
    assert optimizer.last_grad_norm == pytest.approx(float(total), rel=1e-6)
    for (name, p), expected in zip(model.named_parameters(), reference):
        torch.testing.assert_close(p.grad, expected.grad, msg=lambda m: f"{name}: {m}")


def test_non_finite_gradient_norm_stops_before_touching_weights(model):
    optimizer, _ = _inner(model, _optimizer("adamw", {"lr": 0.02}), clip_grad=1.0)
    _random_grads(model, torch.Generator().manual_seed(2))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    next(model.parameters()).grad[0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="gradient norm is nan"):
        optimizer.step()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
