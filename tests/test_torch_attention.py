"""``attention.torch.MultiheadAttention`` against PyTorch's own ``nn.MultiheadAttention`` as the
oracle: same state_dict, same outputs, weights and gradients (inputs and every parameter), for
every mask kind, self- and cross-attention, both layouts; inside stock transformer layers; and
faults at every site repaired (``check="correct"``) or let through (``check="off"``)."""
from __future__ import annotations

import copy

import pytest

from abftgemm.faults import Fault, Recorder

torch = pytest.importorskip("torch", reason="torch is an optional extra (pip install '.[torch]')")
nn = torch.nn

from attention import ALL_SITES, CROSS_SITES, INVARIANT_SITES, SITES  # noqa: E402
from attention.torch import MultiheadAttention, protect  # noqa: E402

E, HEADS, N, L, S = 16, 4, 2, 5, 7
#: Unit roundoff of each dtype, written out from the formats.
U = {torch.float64: 2.0 ** -53, torch.float32: 2.0 ** -24}
#: Longest chain of dependent rounded steps between an input and an output (backward dX:
#: projection, scores, softmax, context, out_proj, dContext, dP, softmax backward, dQ, dX).
CHAIN = 10
MASKS = ("none", "bool-2d", "bool-3d", "float-2d", "float-3d", "bool-padding", "float-padding",
         "bool-padding+bool-3d", "float-padding+float-2d", "causal-hint")
WEIGHTS = {"averaged": (True, True), "per-head": (True, False), "none": (False, True)}


def tolerance(dtype, reference, terms):
    """How far two correct implementations may differ: each sums up to ``terms`` products per
    element in its own order, worst case ``terms * u`` of the magnitude of what it sums (Higham's
    gamma_K, constant 1), twice (both sides), compounded over CHAIN steps. Data are O(1)
    (standard normal), so the magnitude is at least 1."""
    scale = max(float(reference.abs().max()), 1.0) if reference.numel() else 1.0
    return CHAIN * 2 * terms * U[dtype] * scale


def assert_close(got, want, dtype, terms, what):
    assert (got is None) == (want is None), what
    if want is None:
        return
    assert got.shape == want.shape, (what, got.shape, want.shape)
    diff = (got.detach().double() - want.detach().double()).abs()
    err = float(diff.max()) if want.numel() else 0.0
    assert err <= tolerance(dtype, want.detach().double(), terms), (what, err)


def masks(kind, seq_q, seq_k, dtype, gen, batched=True):
    """(attn_mask, key_padding_mask, is_causal) of one kind; key 0 is never hidden, so no query
    row is fully masked (torch gives NaN there, the protected layer 0: documented difference)."""
    n = N if batched else 1
    hide2 = torch.rand((seq_q, seq_k), generator=gen) < 0.4
    hide3 = torch.rand((n * HEADS, seq_q, seq_k), generator=gen) < 0.4
    pad = torch.rand((n, seq_k), generator=gen) < 0.4
    hide2[..., 0] = hide3[..., 0] = pad[:, 0] = False
    fl = lambda shape: torch.randn(shape, generator=gen, dtype=dtype)  # noqa: E731
    if not batched:
        pad = pad[0]
    causal = torch.ones((seq_q, seq_k), dtype=torch.bool).triu(1)
    return {
        "none": (None, None, False),
        "bool-2d": (hide2, None, False),
        "bool-3d": (hide3, None, False),
        "float-2d": (fl((seq_q, seq_k)), None, False),
        "float-3d": (fl((n * HEADS, seq_q, seq_k)), None, False),
        "bool-padding": (None, pad, False),
        "float-padding": (None, fl(pad.shape).masked_fill(pad, float("-inf")), False),
        "bool-padding+bool-3d": (hide3, pad, False),
        "float-padding+float-2d": (fl((seq_q, seq_k)), fl(pad.shape), False),
        "causal-hint": (causal, None, True),
    }[kind]


def pair(dtype, batch_first=True, bias=True, check="correct"):
    """A stock module and a protected one loaded from its state_dict."""
    torch.manual_seed(0)
    stock = nn.MultiheadAttention(E, HEADS, bias=bias, batch_first=batch_first, dtype=dtype)
    with torch.no_grad():  # non-zero biases, so that their routes are tested
        for p in stock.parameters():
            if p.dim() == 1:
                p.normal_()
    mine = MultiheadAttention(E, HEADS, bias=bias, batch_first=batch_first, dtype=dtype,
                              check=check)
    mine.load_state_dict(stock.state_dict())
    return stock, mine


def inputs(dtype, batch_first, cross, gen, batched=True, key_is_value=False):
    def make(seq):
        shape = ((N, seq, E) if batch_first else (seq, N, E)) if batched else (seq, E)
        return torch.randn(shape, generator=gen, dtype=dtype).requires_grad_()

    q = make(L)
    if not cross:
        return q, q, q
    k = make(S)
    return q, k, (k if key_is_value else make(S))


def fwd_bwd(module, q, k, v, gen_seed=1, **kw):
    """Output, weights, and the gradients of ``sum(y * g)`` (``g`` fixed random) w.r.t. the
    inputs and every parameter."""
    for t in (*module.parameters(), q, k, v):
        t.grad = None
    y, w = module(q, k, v, **kw)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(gen_seed), dtype=y.dtype)
    (y * g).sum().backward()
    grads = {name: p.grad for name, p in module.named_parameters()}
    distinct = {id(t): t for t in (q, k, v)}.values()
    return {"y": y.detach(), "weights": w, **grads,
            **{f"d_input{i}": t.grad for i, t in enumerate(distinct)}}


def compare(got, want, dtype, terms):
    assert got.keys() == want.keys()
    for key in want:
        assert_close(got[key], want[key], dtype, terms, key)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch-first", "seq-first"])
@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
@pytest.mark.parametrize("weights", WEIGHTS)
def test_matches_torch(dtype, mask, batch_first, cross, weights):
    gen = torch.Generator().manual_seed(2)
    stock, mine = pair(dtype, batch_first)
    q, k, v = inputs(dtype, batch_first, cross, gen)
    seq_k = S if cross else L
    attn_mask, padding, is_causal = masks(mask, L, seq_k, dtype, gen)
    need, average = WEIGHTS[weights]
    kw = dict(attn_mask=attn_mask, key_padding_mask=padding, is_causal=is_causal,
              need_weights=need, average_attn_weights=average)
    want = fwd_bwd(stock, q, k, v, **kw)
    got = fwd_bwd(mine, q, k, v, **kw)
    compare(got, want, dtype, terms=max(E, seq_k, N * L))
    assert not mine.last_report.detected, mine.last_report.summary()


@pytest.mark.parametrize("mask", ["float-2d", "float-3d", "float-padding",
                                  "float-padding+float-2d"])
@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_learned_float_masks_get_their_gradients(mask, cross):
    """A float mask that requires grad (a learned position bias) gets the gradient PyTorch gives
    it: the checked dS, summed over what the mask broadcasts over (heads and queries for a key
    padding mask)."""
    gen, dtype = torch.Generator().manual_seed(5), torch.float64
    stock, mine = pair(dtype)
    q, k, v = inputs(dtype, True, cross, gen)
    attn_mask, padding, _ = masks(mask, L, S if cross else L, dtype, gen)
    learned = [m.requires_grad_() for m in (attn_mask, padding) if m is not None]
    runs = []
    for module in (stock, mine):
        for m in learned:
            m.grad = None
        got = fwd_bwd(module, q, k, v, attn_mask=attn_mask, key_padding_mask=padding)
        runs.append({**got, **{f"d_mask{i}": m.grad for i, m in enumerate(learned)}})
    compare(runs[1], runs[0], dtype, terms=N * S)
    assert all(m.grad is not None for m in learned)
    assert mine.last_core == "unfused"


@pytest.mark.parametrize("mask", ["none", "bool-3d", "float-padding", "bool-padding+bool-3d"])
@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_unbatched_inputs_match_torch(mask, cross):
    gen, dtype = torch.Generator().manual_seed(3), torch.float64
    stock, mine = pair(dtype)
    q, k, v = inputs(dtype, True, cross, gen, batched=False)
    attn_mask, padding, is_causal = masks(mask, L, S if cross else L, dtype, gen, batched=False)
    for average in (True, False):
        kw = dict(attn_mask=attn_mask, key_padding_mask=padding, average_attn_weights=average)
        compare(fwd_bwd(mine, q, k, v, **kw), fwd_bwd(stock, q, k, v, **kw), dtype, terms=S)


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch-first", "seq-first"])
def test_without_bias_and_with_key_is_value(batch_first):
    gen, dtype = torch.Generator().manual_seed(4), torch.float64
    stock, mine = pair(dtype, batch_first, bias=False)
    assert mine.in_proj_bias is None and mine.out_proj.bias is None
    q, k, v = inputs(dtype, batch_first, True, gen, key_is_value=True)
    compare(fwd_bwd(mine, q, k, v), fwd_bwd(stock, q, k, v), dtype, terms=N * S)


def test_is_causal_without_a_mask_applies_the_causal_mask():
    """PyTorch requires attn_mask with is_causal; the protected module applies the causal mask
    itself, equal to PyTorch's output with the explicit mask."""
    gen, dtype = torch.Generator().manual_seed(11), torch.float64
    stock, mine = pair(dtype)
    q, k, v = inputs(dtype, True, False, gen)
    causal = torch.ones((L, L), dtype=torch.bool).triu(1)
    compare(fwd_bwd(mine, q, k, v, is_causal=True), fwd_bwd(stock, q, k, v, attn_mask=causal),
            dtype, terms=N * L)


def test_is_causal_across_lengths_is_top_left_aligned():
    """Cross-attention (``L != S``) with ``is_causal`` and no mask: query ``i`` sees keys ``j <=
    i``, the triangle aligned top-left as ``scaled_dot_product_attention``'s ``is_causal``."""
    gen, dtype = torch.Generator().manual_seed(12), torch.float64
    stock, mine = pair(dtype)
    q, k, v = inputs(dtype, True, True, gen)
    assert q.shape[1] != k.shape[1]
    top_left = torch.ones((q.shape[1], k.shape[1]), dtype=torch.bool).triu(1)
    compare(fwd_bwd(mine, q, k, v, is_causal=True), fwd_bwd(stock, q, k, v, attn_mask=top_left),
            dtype, terms=N * L)


def test_same_parameters_and_state_dict_as_torch():
    stock, mine = pair(torch.float32)
    assert isinstance(mine, nn.MultiheadAttention)
    assert list(mine.state_dict()) == list(stock.state_dict())
    assert [n for n, _ in mine.named_parameters()] == [n for n, _ in stock.named_parameters()]
    # from_torch and protect() keep the very Parameter objects (an optimizer still holds them).
    shared = MultiheadAttention.from_torch(stock)
    assert all(a is b for a, b in zip(shared.parameters(), stock.parameters()))
    model = nn.Sequential(nn.Linear(E, E), stock)
    before = list(model.parameters())
    protect(model)
    assert isinstance(model[1], MultiheadAttention)
    assert all(a is b for a, b in zip(model.parameters(), before))


def test_follows_parameters_updated_in_place_or_replaced():
    """The module keeps its views of the parameters between calls: an in-place update (an
    optimizer step, load_state_dict) and a new tensor assigned to ``.data`` must both be seen."""
    gen, dtype = torch.Generator().manual_seed(12), torch.float64
    stock, mine = pair(dtype)
    q, k, v = inputs(dtype, True, False, gen)
    compare(fwd_bwd(mine, q, k, v), fwd_bwd(stock, q, k, v), dtype, terms=N * L)
    with torch.no_grad():
        for p in stock.parameters():
            p.mul_(-1.5)
    mine.load_state_dict(stock.state_dict())  # copies into the same memory
    compare(fwd_bwd(mine, q, k, v), fwd_bwd(stock, q, k, v), dtype, terms=N * L)
    for name in ("in_proj_weight", "in_proj_bias"):
        new = torch.randn(getattr(stock, name).shape, generator=gen, dtype=dtype)
        getattr(stock, name).data = new
        getattr(mine, name).data = new.clone()  # other memory
    compare(fwd_bwd(mine, q, k, v), fwd_bwd(stock, q, k, v), dtype, terms=N * L)


# ------------------------------------------------------------------------ stock transformer


def encoder_layers(batch_first, dtype=torch.float64):
    torch.manual_seed(5)
    stock = nn.TransformerEncoderLayer(E, HEADS, dim_feedforward=32, dropout=0.0,
                                       batch_first=batch_first, dtype=dtype)
    mine = protect(copy.deepcopy(stock))
    assert isinstance(mine.self_attn, MultiheadAttention)
    return stock, mine


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch-first", "seq-first"])
def test_inside_a_stock_transformer_encoder_layer(batch_first):
    dtype, gen = torch.float64, torch.Generator().manual_seed(6)
    stock, mine = encoder_layers(batch_first, dtype)
    x = torch.randn((N, L, E) if batch_first else (L, N, E), generator=gen, dtype=dtype)
    causal = nn.Transformer.generate_square_subsequent_mask(L, dtype=dtype)
    padding = torch.zeros((N, L), dtype=torch.bool)
    padding[1, -2:] = True
    results = []
    for layer in (stock, mine):
        xi = x.clone().requires_grad_()
        y = layer(xi, src_mask=causal, src_key_padding_mask=padding, is_causal=True)
        (y * y.detach().sin()).sum().backward()
        results.append({"y": y.detach(), "dx": xi.grad,
                        **{n: p.grad for n, p in layer.named_parameters()}})
    compare(results[1], results[0], dtype, terms=max(32, N * L))
    assert mine.self_attn.last_report.checked, "the protected forward did not run"


@pytest.mark.parametrize("functional", [False, True], ids=["module", "attention_core"])
def test_a_loss_on_the_returned_weights_raises_instead_of_losing_its_gradient(functional):
    """The weights have no gradient path into the protected backward: a loss that reaches them
    raises in backward; one on the output alone, or on detached weights, trains."""
    from attention.torch_functional import Protection, attention_core

    _, mine = pair(torch.float64)
    x = torch.randn(N, L, E, dtype=torch.float64, requires_grad=True)

    def run():
        if functional:
            q = x.view(N, L, HEADS, E // HEADS).transpose(1, 2)
            return attention_core(q, q, q, protection=Protection(), need_weights=True)
        return mine(x, x, x, need_weights=True)

    y, w = run()
    with pytest.raises(NotImplementedError, match="attention weights"):
        (y.sum() + w.pow(2).sum()).backward()
    y, w = run()
    (y.sum() + w.detach().pow(2).sum()).backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_protect_swaps_every_occurrence_keeps_hooks_and_returns_a_bare_module_protected():
    """One protected module per original, under each of its names; the original's hooks and
    attributes come along (their handles still remove them); a bare module comes back
    protected, holding its Parameters."""
    stock = nn.MultiheadAttention(E, HEADS, batch_first=True)
    bare = protect(stock)
    assert isinstance(bare, MultiheadAttention) and bare.in_proj_weight is stock.in_proj_weight
    calls = []
    stock.register_forward_pre_hook(lambda m, args: calls.append("pre"))
    handle = stock.register_forward_hook(lambda m, args, out: calls.append("forward"))
    stock.register_full_backward_hook(lambda m, g_in, g_out: calls.append("backward"))
    stock.tag = "kept"
    model = nn.ModuleDict({"first": stock, "second": stock})
    protect(model)
    assert isinstance(model["first"], MultiheadAttention) and model["first"] is model["second"]
    assert model["first"].tag == "kept"
    x = torch.randn(N, L, E, requires_grad=True)
    model["first"](x, x, x)[0].sum().backward()
    assert calls == ["pre", "forward", "backward"]
    handle.remove()
    calls.clear()
    model["second"](x, x, x)
    assert calls == ["pre"]


def test_a_computed_in_proj_weight_is_refused_and_nothing_changes():
    """A pruned (or parametrized) in_proj_weight is computed, not a Parameter the protected
    module could share: refused before any module is swapped."""
    prune = pytest.importorskip("torch.nn.utils.prune")
    model = nn.ModuleDict({"plain": nn.MultiheadAttention(E, HEADS),
                           "pruned": nn.MultiheadAttention(E, HEADS)})
    prune.l1_unstructured(model["pruned"], "in_proj_weight", amount=0.5)
    with pytest.raises(ValueError, match="in_proj_weight is computed"):
        protect(model)
    assert not any(isinstance(m, MultiheadAttention) for m in model.values())


def test_fault_hook_names_the_sites_of_a_protected_torch_model_and_restores_its_hooks():
    """``attention.torch.fault_hook`` on a model that ``protect`` gave MultiheadAttention
    modules (no transformers involved): every product's site, named by its module; on a bare
    module, the site alone; the hooks set before are back after the block."""
    from attention.torch import fault_hook

    _, model = encoder_layers(True, torch.float64)
    seen = []
    earlier = Recorder()
    model.self_attn.fault_hook = earlier
    x = torch.randn(N, L, E, dtype=torch.float64, requires_grad=True)
    with fault_hook(model, lambda site, c: seen.append(site)):
        model(x).sum().backward()
    assert {f"self_attn:{s}" for s in ("q_proj", "out_proj", "d_wq")} <= set(seen)
    assert model.self_attn.fault_hook is earlier
    bare = []
    with fault_hook(model.self_attn, lambda site, c: bare.append(site)):
        model(x)
    assert "q_proj" in bare
    with pytest.raises(ValueError, match="no protected module"):
        with fault_hook(nn.Linear(2, 2), print):
            pass


@pytest.mark.parametrize("nested", [False, True], ids=["layer", "encoder-with-padding"])
def test_inference_fast_paths_still_run_the_protected_forward(nested):
    """In eval mode under no_grad, TransformerEncoderLayer and TransformerEncoder take fused
    paths that read the weights and skip self_attn.forward; the protected module keeps them off."""
    dtype, gen = torch.float32, torch.Generator().manual_seed(7)
    stock, mine = encoder_layers(True, dtype)
    if nested:
        stock, mine = (protect(nn.TransformerEncoder(layer, 1, enable_nested_tensor=True))
                       if layer is mine else nn.TransformerEncoder(layer, 1)
                       for layer in (stock, mine))
    stock.eval(), mine.eval()
    x = torch.randn((N, L, E), generator=gen, dtype=dtype)
    padding = torch.zeros((N, L), dtype=torch.bool)
    padding[1, -2:] = True
    attn = mine.layers[0].self_attn if nested else mine.self_attn
    attn.fault_hook = seen = Recorder()
    with torch.no_grad():
        y = mine(x, src_key_padding_mask=padding)
        want = stock(x, src_key_padding_mask=padding)
    assert {c.site for c in seen.calls} >= {"q_proj", "out_proj"}
    valid = ~padding  # the fused path zeroes padded positions' outputs; compare the others
    assert_close(y[valid], want[valid], dtype, terms=32, what="y")


# ------------------------------------------------------------------------ faults


FAULT_SITES = ALL_SITES + tuple(INVARIANT_SITES)


@pytest.mark.parametrize("site", FAULT_SITES)
@pytest.mark.parametrize("kind", ["nan", "near-inf"])
def test_fault_at_every_site_is_repaired_and_corrupts_without_protection(site, kind):
    dtype, gen = torch.float64, torch.Generator().manual_seed(8)
    cross = site in CROSS_SITES
    stock, mine = pair(dtype, batch_first=False)
    q, k, v = inputs(dtype, False, cross, gen)
    padding = masks("bool-padding", L, S if cross else L, dtype, gen)[1]  # key 0 never hidden
    fault_free = fwd_bwd(mine, q, k, v, key_padding_mask=padding)
    terms = max(E, S, N * L)
    for check in ("correct", "off"):
        mine.check = check
        mine.fault_hook = fault = Fault(kind, "row", seed=9, sites=site, row=0)
        got = fwd_bwd(mine, q, k, v, key_padding_mask=padding)
        assert fault.injected, "the fault never fired"
        if check == "correct":
            assert site in mine.last_report.sites, mine.last_report.summary()
            # A rebuilt element is a float64 checksum minus a sum of up to K other elements:
            # rounding up to K u of K terms of the data's scale, well inside the tolerance's
            # 2 CHAIN K u with K >= 8.
            compare(got, fault_free, dtype, terms)
        else:
            assert not all(_close(got[key], fault_free[key], dtype, terms)
                           for key in fault_free), "the unprotected fault changed nothing"


def _close(got, want, dtype, terms):
    if want is None:
        return got is None
    diff = (got.detach().double() - want.detach().double()).abs()
    return bool(diff.isfinite().all()) and float(diff.max()) <= tolerance(dtype, want.detach(),
                                                                          terms)


def test_hook_sees_every_site_and_report_covers_forward_and_backward():
    gen, dtype = torch.Generator().manual_seed(10), torch.float32
    for cross, sites in ((False, SITES), (True, ALL_SITES)):
        _, mine = pair(dtype)
        mine.fault_hook = seen = Recorder()
        fwd_bwd(mine, *inputs(dtype, True, cross, gen))
        assert {c.site for c in seen.calls} == set(sites) | set(INVARIANT_SITES)
        assert set(mine.last_report.checked) >= set(sites)


# ------------------------------------------------------------------------ refusals


@pytest.mark.parametrize("kwargs, match", [
    ({"dropout": 1.5}, "dropout must be a probability"),
    ({"add_bias_kv": True}, "add_bias_kv"),
    ({"add_zero_attn": True}, "add_zero_attn"),
    ({"kdim": 8}, "kdim=8"),
    ({"vdim": 8}, "vdim=8"),
    ({"check": "sometimes"}, "check must be one of"),
])
def test_unsupported_arguments_raise_naming_them(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MultiheadAttention(E, HEADS, **kwargs)
    if "check" not in kwargs:
        with pytest.raises(ValueError, match=match.split("=")[0]):
            MultiheadAttention.from_torch(nn.MultiheadAttention(E, HEADS, **kwargs))


def test_bad_inputs_raise_clearly():
    _, mine = pair(torch.float32)
    x = torch.randn(N, L, E)
    with pytest.raises(ValueError, match="key_padding_mask must have shape"):
        mine(x, x, x, key_padding_mask=torch.zeros(N, L + 1, dtype=torch.bool))
    with pytest.raises(TypeError, match="key_padding_mask must be bool or float"):
        mine(x, x, x, key_padding_mask=torch.zeros(N, L, dtype=torch.int64))
    with pytest.raises(TypeError, match="attn_mask must be bool"):
        mine(x, x, x, attn_mask=torch.zeros(L, L, dtype=torch.int64))
    with pytest.raises(ValueError, match="attn_mask must have shape"):
        mine(x, x, x, attn_mask=torch.zeros(L, L + 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="query must be 2-D"):
        mine(x[0, 0], x[0, 0], x[0, 0])
    with pytest.raises(ValueError, match="key must be 3-D"):
        mine(x, x[0], x[0])
    narrow = x[..., :E // 2]  # the weights were blamed: "in_proj_weight ... must be ..."
    with pytest.raises(ValueError, match=f"query's embedding dimension is {E // 2}, the weights' "
                       f"{E}"):
        mine(narrow, narrow, narrow)
    nested = torch.nested.nested_tensor([torch.randn(L, E), torch.randn(L - 1, E)])
    with pytest.raises(ValueError, match="nested tensor.*use_nested_tensor"):
        mine(nested, nested, nested)
    for args in ((x.double(), x, x), (x, x.double(), x.double())):
        with pytest.raises(TypeError, match="(query|key) has dtype torch.float64; the projection"):
            mine(*args)
    for padding in (None, torch.zeros(N, L), torch.zeros(N, L, dtype=torch.bool)):
        for shape in ((L,), (1, L), (L, 1), (N * HEADS, 1, L), (1, L, L), (1, 1, L, L)):
            # as stock refuses them: a float padding mask once broadcast them in
            with pytest.raises(ValueError, match="attn_mask must have shape"):
                mine(x, x, x, key_padding_mask=padding, attn_mask=torch.zeros(shape))


@pytest.mark.parametrize("empty", ["batch", "query", "key"])
def test_empty_inputs_return_what_stock_returns(empty):
    stock, mine = pair(torch.float32)
    n, seq_q, seq_k = (0 if empty == "batch" else N, 0 if empty == "query" else L,
                       0 if empty == "key" else S)
    q, kv = torch.randn(n, seq_q, E), torch.randn(n, seq_k, E)
    for weights in (True, False):
        got, want = mine(q, kv, kv, need_weights=weights), stock(q, kv, kv, need_weights=weights)
        assert got[0].shape == want[0].shape
        assert (got[1] is None) == (want[1] is None)
        if weights:
            assert got[1].shape == want[1].shape


@pytest.mark.parametrize("mask", ["bool-2d", "float-2d", "bool-3d"])
@pytest.mark.parametrize("empty", ["query", "key"])
def test_masks_over_empty_sequences_match_torch(empty, mask):
    """An ``attn_mask`` of a zero-length query or key sequence is taken as stock takes it (its
    reshape to ``(-1, L, S)`` was ambiguous: NumPy's ValueError "cannot reshape array of size
    0")."""
    dtype = torch.float64
    stock, mine = pair(dtype)
    seq_q, seq_k = (0, S) if empty == "query" else (L, 0)
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(N, seq_q, E, generator=gen, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(N, seq_k, E, generator=gen, dtype=dtype, requires_grad=True)
            for _ in range(2))
    shape = (N * HEADS, seq_q, seq_k) if mask.endswith("3d") else (seq_q, seq_k)
    attn_mask = torch.zeros(shape, dtype=torch.bool if mask.startswith("bool") else dtype)
    # stock's own sdpa path refuses a 3-D mask over no keys (its reshape to -1 is ambiguous)
    for need in (True,) if shape == (N * HEADS, L, 0) else (True, False):
        kw = dict(attn_mask=attn_mask, need_weights=need, average_attn_weights=False)
        compare(fwd_bwd(mine, q, k, v, **kw), fwd_bwd(stock, q, k, v, **kw), dtype, terms=E)


@pytest.mark.parametrize("weights", [True, False], ids=["unfused", "fused"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("mask", ["float-2d", "float-padding+float-2d", "bool-padding"])
def test_16_bit_modules_take_masks_of_their_dtype(dtype, mask, weights):
    """PyTorch wants float masks in the query's dtype; in 16 bits they must be taken (they were
    refused for bfloat16 once), and the outputs and gradients agree with float64 math on the
    same (rounded) weights, inputs and masks within the 16-bit rounding of a few steps."""
    gen = torch.Generator().manual_seed(5)
    _, mine = pair(dtype)
    reference = copy.deepcopy(mine).double()
    q, k, v = inputs(dtype, True, True, gen)
    attn_mask, padding, _ = masks(mask, L, S, dtype, gen)
    g = torch.randn((N, L, E), generator=gen, dtype=torch.float64)

    def run(module, q, k, v, attn_mask):
        # need_weights=False: the fused core (16-bit data computed in float32)
        y, _ = module(q, k, v, attn_mask=attn_mask, key_padding_mask=padding,
                      need_weights=weights)
        (y * g.to(y.dtype)).sum().backward()
        return [y.detach(), q.grad, k.grad, v.grad, *(p.grad for p in module.parameters())]

    got = run(mine, q, k, v, attn_mask)
    assert not mine.last_report.detected, mine.last_report.summary()
    assert mine.last_core == ("unfused" if weights else "fused")
    if not weights:  # 16-bit data: tiles in float32, the final checks included
        assert {"fused:out", "fused:dV_out", "fused:dK_out"} <= set(mine.last_report.checked)
    want = run(reference, *(t.detach().double().requires_grad_() for t in (q, k, v)),
               None if attn_mask is None else attn_mask.double())
    u = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    for i, (a, w) in enumerate(zip(got, want)):
        scale = max(float(w.abs().max()), 1.0)
        err = float((a.double() - w).abs().max())
        assert err <= 4 * CHAIN * u * scale, (i, err, scale)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_cuda_module_on_a_side_stream_matches_the_cpu():
    """Forward and backward on a non-default stream: the core runs on PyTorch's current stream,
    so the gradients autograd receives are complete (equal to the CPU module's)."""
    gen = torch.Generator().manual_seed(6)
    _, cpu = pair(torch.float64)
    gpu = copy.deepcopy(cpu).cuda()
    q, k, v = inputs(torch.float64, True, True, gen)
    want = fwd_bwd(cpu, q, k, v)
    qc, kc, vc = (t.detach().cuda().requires_grad_() for t in (q, k, v))
    g = torch.randn(want["y"].shape, generator=torch.Generator().manual_seed(1),
                    dtype=torch.float64)  # fwd_bwd's
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        y, w = gpu(qc, kc, vc)
        (y * g.cuda()).sum().backward()
        got = {"y": y.detach(), "weights": w,
               **{name: p.grad for name, p in gpu.named_parameters()},
               **{f"d_input{i}": t.grad for i, t in enumerate((qc, kc, vc))}}
        got = {key: None if t is None else t.cpu() for key, t in got.items()}
    compare(got, want, torch.float64, terms=N * S)


def test_last_report_is_the_last_pass_forward_and_backward():
    """``last_report`` holds the last forward's findings, extended by its backward when autograd
    runs it; the backward of an earlier forward extends that forward's report, which becomes the
    last one again: the meaning of :attr:`attention.MultiHeadAttention.last_report`
    (tests/test_attention.py). The functional entry point reports to the Protection it is
    given."""
    from attention.torch_functional import Protection, multi_head_attention

    gen = torch.Generator().manual_seed(4)
    mine = MultiheadAttention(E, HEADS, batch_first=True, dtype=torch.float64)
    x = torch.randn(N, L, E, dtype=torch.float64, generator=gen, requires_grad=True)
    mine.fault_hook = Fault("additive", "element", seed=2, magnitude=1e3, sites={"q_proj"})
    first, _ = mine(x, x, x, need_weights=False)
    faulty = mine.last_report
    assert faulty.sites == {"q_proj"} and "d_x" not in faulty.checked
    forward_checks = dict(faulty.checked)
    mine.fault_hook = None
    second, _ = mine(x, x, x, need_weights=False)
    assert mine.last_report is not faulty and not mine.last_report.events
    first.sum().backward()
    assert mine.last_report is faulty and faulty.sites == {"q_proj"}
    assert faulty.checked["d_x"] == 1
    assert all(faulty.checked[s] == n for s, n in forward_checks.items())

    protection = Protection()
    y, _ = multi_head_attention(x, x, x, HEADS, mine.in_proj_weight, mine.in_proj_bias,
                                mine.out_proj.weight, mine.out_proj.bias, protection=protection)
    y.sum().backward()
    assert protection.last_report.checked["d_x"] == 1 and not protection.last_report.events
    assert torch.equal(y, second)


def test_a_module_called_twice_in_a_step_keeps_every_finding_in_total_report():
    """A module called twice in one step (a shared layer, as ALBERT's): autograd runs the
    second call's backward first, then the first's, whose report ends as ``last_report``; a
    fault repaired in the second call's backward (the first ``d_x`` that runs) was in no report
    the user could reach. ``total_report`` holds every call's findings (forward and backward,
    each once) until the user replaces it."""
    from abftgemm.report import Report

    gen = torch.Generator().manual_seed(6)
    mine = MultiheadAttention(E, HEADS, batch_first=True, dtype=torch.float64)
    x = torch.randn(N, L, E, dtype=torch.float64, generator=gen, requires_grad=True)
    seen = []

    def hook(site, c):
        seen.append(site)
        if site == "d_x" and seen.count("d_x") == 1:  # the second call's backward
            c.flat[0] = float("inf")

    mine.fault_hook = hook
    mine.total_report = Report()
    first, _ = mine(x, x, x, need_weights=False)
    second, _ = mine(first, first, first, need_weights=False)
    second.sum().backward()
    assert seen.count("d_x") >= 2  # (the repaired pass is replayed: 3)
    assert not mine.last_report.events  # the first call's, as documented
    total = mine.total_report
    assert total.sites == {"d_x"} and total.corrected >= 1, total.summary()
    once = mine.last_report.checked  # the first call's checks, forward and backward
    assert total.checked == {s: 2 * n for s, n in once.items()}
    assert mine.protection.total_report is total
    mine.total_report = Report()
    mine(x, x, x, need_weights=False)
    assert mine.total_report.checked == mine.last_report.checked
    assert not mine.total_report.events

    # the core alone (Hugging Face attention modules' ProtectedCore): the same
    from attention.torch_functional import Protection, attention_core

    seen.clear()
    protection = Protection(fault_hook=lambda site, c: hook("d_x" if site == "d_q" else site, c))
    q = x.view(N, L, HEADS, E // HEADS).transpose(1, 2)
    out, _ = attention_core(q, q, q, protection=protection)
    out, _ = attention_core(out, out, out, protection=protection)
    out.sum().backward()
    assert not protection.last_report.events
    assert protection.total_report.sites == {"d_q"}, protection.total_report.summary()


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_call_that_raises_adds_its_findings_to_total_report(where):
    """A call that raises ``UncorrectableError`` (a fault at the fused core's scores tile that
    persists through its recomputation) adds the error's findings to ``total_report``: a loop
    that skips such a step still sees them there; the next call's report is clean."""
    from abftgemm import UncorrectableError
    from abftgemm.report import Report

    gen = torch.Generator().manual_seed(7)
    mine = MultiheadAttention(E, HEADS, batch_first=True, core="fused")
    x = torch.randn(N, L, E, generator=gen, requires_grad=True)
    site = "fused:S" if where == "forward" else "fused:dP"
    mine.fault_hook = Fault("nan", "element", seed=1, sites={site}, times=None)
    mine.total_report = Report()
    with pytest.raises(UncorrectableError) as raised:
        y, _ = mine(x, x, x, need_weights=False)
        y.sum().backward()
    assert raised.value.report.sites == {site}
    assert mine.total_report.sites == {site}, mine.total_report.summary()
    assert len(mine.total_report.events) >= len(raised.value.report.events)
    mine.fault_hook = None
    y, _ = mine(x, x, x, need_weights=False)
    y.sum().backward()
    assert not mine.last_report.events and mine.last_report.checked["d_x"] == 1


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("call", [0, 1], ids=["forward", "recomputation"])
def test_checkpointed_module_reports_every_repaired_fault(reentrant, call):
    """Under activation checkpointing the module's forward runs again in backward: a fault
    repaired in the first forward was dropped from ``last_report`` (the recomputation began a
    report of its own, which the backward extended); one repaired in the recomputation is
    there too. The step equals the unfaulted one."""
    from torch.utils.checkpoint import checkpoint

    from abftgemm.report import Report
    from attention._torch_arrays import recomputing

    gen = torch.Generator().manual_seed(5)
    mine = MultiheadAttention(E, HEADS, batch_first=True, dtype=torch.float64)
    x = torch.randn(N, L, E, dtype=torch.float64, generator=gen)
    grads = []
    for faulty in (False, True):
        injected = []

        def hook(site, c):
            if faulty and site == "q_proj" and not injected and recomputing() == bool(call):
                injected.append(site)
                c.flat[0] = float("inf")

        mine.fault_hook = hook
        mine.zero_grad()
        mine.total_report = Report()
        xi = x.clone().requires_grad_(True)
        y = checkpoint(lambda t: mine(t, t, t, need_weights=False)[0], xi,
                       use_reentrant=reentrant)
        y.sum().backward()
        assert bool(injected) == faulty
        assert mine.last_report.detected == faulty, mine.last_report.summary()
        assert mine.last_report.checked["d_x"] == 1
        # the step's every call (forward, recomputation, backward), each once
        assert mine.total_report.checked == mine.last_report.checked
        assert mine.total_report.events == mine.last_report.events
        grads.append((y.detach(), xi.grad, mine.in_proj_weight.grad.clone()))
    for got, want in zip(*grads):
        assert torch.equal(got, want)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_checkpointed_recomputation_repeats_its_forwards_check_decisions(reentrant):
    """Under a plan that checks every other call, activation checkpointing's recomputation drew
    its own decisions, the second call of the schedule: the forward was checked, the
    recomputation (whose tensors the backward reads) never, so a fault there reached the
    gradients in every step (weight gradient off by 1.5). The recomputation repeats its
    forward's decisions, as a replay does: the schedule advances once per step."""
    from torch.utils.checkpoint import checkpoint

    from attention import CheckingPlan
    from attention._torch_arrays import recomputing
    from attention.plan import SitePlan

    gen = torch.Generator().manual_seed(8)
    plan = CheckingPlan({s: SitePlan(every=2) for s in SITES})
    mine = MultiheadAttention(E, HEADS, batch_first=True, dtype=torch.float64, plan=plan)
    ref = MultiheadAttention(E, HEADS, batch_first=True, dtype=torch.float64)
    ref.load_state_dict(mine.state_dict())
    x = torch.randn(N, L, E, dtype=torch.float64, generator=gen)
    injected = []

    def hook(site, c):  # a fault in the first step's recomputation only
        if site == "q_proj" and recomputing() and not injected:
            injected.append(site)
            c.flat[0] += 1e3

    mine.fault_hook = hook
    checked = []
    for _ in range(3):
        mine.zero_grad()
        ref.zero_grad()
        xi, xr = (x.clone().requires_grad_(True) for _ in range(2))
        y = checkpoint(lambda t: mine(t, t, t, need_weights=False)[0], xi,
                       use_reentrant=reentrant)
        y.sum().backward()
        ref(xr, xr, xr, need_weights=False)[0].sum().backward()
        checked.append(mine.last_report.checked.get("q_proj", 0))
        if len(checked) == 1:
            assert injected and mine.last_report.sites == {"q_proj"}, \
                mine.last_report.summary()
            assert torch.allclose(mine.in_proj_weight.grad, ref.in_proj_weight.grad,
                                  rtol=1e-9, atol=1e-9)
    once = checked[0] // 2  # the forward's checks, repeated by the recomputation
    assert once > 0 and checked == [2 * once, 0, 2 * once]


def test_check_and_plan_set_through_the_module_are_validated():
    """``plan = None`` on a module means the default plan (it failed at the next forward with
    an AttributeError deep in the pass); a plan that is not one, or a bad check mode, is refused
    when set, and the module keeps what it had."""
    from attention import CheckingPlan
    from attention.torch_core import ProtectedCore

    mine = MultiheadAttention(E, HEADS, batch_first=True)
    x = torch.randn(N, L, E)
    mine.plan = None
    assert isinstance(mine.plan, CheckingPlan)
    mine(x, x, x)
    assert mine.last_report.checked["q_proj"] > 0
    kept = mine.plan
    with pytest.raises(TypeError, match="plan must be an attention.CheckingPlan"):
        mine.plan = "every"
    with pytest.raises(ValueError, match="check must be one of"):
        mine.check = "corect"
    assert mine.plan is kept and mine.check == "correct"
    core = ProtectedCore()
    core.plan = None
    assert isinstance(core.plan, CheckingPlan)


def test_a_protection_pickled_before_check_and_plan_were_properties_loads():
    """States pickled with ``check`` and ``plan`` as plain attributes load (the properties
    shadowed them: ``AttributeError: _check``)."""
    from attention import CheckingPlan
    from attention.torch_functional import Protection

    old = Protection.__new__(Protection)
    state = Protection("detect").__getstate__()
    state["check"], state["plan"] = state.pop("_check"), state.pop("_plan")
    old.__setstate__(state)
    assert old.check == "detect" and isinstance(old.plan, CheckingPlan)


def test_an_unbatched_query_with_a_2d_key_padding_mask_is_told_its_own_shape():
    """An unbatched (2-D) query takes a 1-D key padding mask, as ``nn.MultiheadAttention``
    says; the error named the shape after a batch dimension was added ("got (1, 1, 3)")."""
    mha = MultiheadAttention(8, 2)
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match=r"must be 1-D \(seq_k,\), got shape \(1, 3\)"):
        mha(x, x, x, key_padding_mask=torch.zeros(1, 3, dtype=torch.bool))
