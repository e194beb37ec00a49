"""The canonical form (normalize.py) and the dataflow matcher (match.py) on small graphs."""
import functools
import operator

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn
from trifuse.fusion import rewrite
from trifuse.fusion.match import compile_pattern, matches, trace_function
from trifuse.fusion.normalize import _batched_product, canonicalize, canonicalize_graph, squares_as_powers
from trifuse.patterns import bias_gelu, dropout_add, layer_norm
from trifuse.patterns._base import Pattern


def _calls(gm):
    return [(n.op, n.target, n.args[1:], dict(n.kwargs)) for n in gm.graph.nodes if n.op.startswith("call")]


def test_modules_become_functions_with_defaults_spelled_out():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.act, self.ln, self.drop = nn.Linear(4, 4), nn.GELU(), nn.LayerNorm(4), nn.Dropout(0.25)

        def forward(self, x):
            return self.drop(self.ln(self.act(self.fc(x)))).tanh()

    m = M()
    gm = canonicalize(fx.symbolic_trace(m), m)
    targets = [t for _, t, _, _ in _calls(gm)]
    assert targets == [F.linear, F.gelu, F.layer_norm, F.dropout, torch.tanh]
    gelu = next(c for c in _calls(gm) if c[1] is F.gelu)
    assert gelu[3] == {"approximate": "none"}
    dropout = next(c for c in _calls(gm) if c[1] is F.dropout)
    assert dropout[2] == (0.25, True, False)  # p, the module's training flag, inplace
    x = torch.randn(2, 4)
    m.eval()
    torch.testing.assert_close(canonicalize(fx.symbolic_trace(m), m)(x), m(x))


def test_a_module_with_hooks_stays_a_module_call():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(4)

        def forward(self, x):
            return self.ln(x)

    m = M()
    m.ln.register_forward_hook(lambda mod, inp, out: out * 2)
    gm = canonicalize(fx.symbolic_trace(m), m)
    assert any(n.op == "call_module" for n in gm.graph.nodes)


def test_spellings_of_one_call_become_one_form():
    def a(x, y):
        return torch.add(x, y).pow(2).softmax(-1)

    def b(x, y):
        return torch.softmax(torch.pow(x + y, 2), -1, None)

    def c(x, y):
        return F.softmax(operator.pow(y.add(x), 2), dim=-1)

    forms = []
    for fn in (a, b, c):
        g = trace_function(fn)
        forms.append([(n.target, len(n.args)) for n in g.nodes if n.op == "call_function"])
    assert forms[0] == forms[1] == forms[2]
    # Granite's `torch.logsumexp(s, dim=-1)`, positionally or as a method
    forms = [[(n.target, n.args[1:], n.kwargs) for n in trace_function(fn).nodes if n.op == "call_function"]
             for fn in (lambda x: torch.logsumexp(x, dim=-1), lambda x: x.logsumexp(-1, False),
                        lambda x: torch.logsumexp(x, -1))]
    assert forms[0] == forms[1] == forms[2] == [(torch.logsumexp, (-1, False), {})]
    # torchtitan's `torch.unsqueeze(x, dim=3)` and the method
    forms = [[(n.target, n.args[1:], n.kwargs) for n in trace_function(fn).nodes if n.op == "call_function"]
             for fn in (lambda x: torch.unsqueeze(x, dim=3), lambda x: x.unsqueeze(3), lambda x: x.unsqueeze(dim=3),
                        lambda x: x[:, :, :, None], lambda x: x[..., None, :, :], lambda x: x[:, :, :, None, ...])]
    assert all(f == [(torch.unsqueeze, (3,), {})] for f in forms[:3]), forms
    assert forms[3] == forms[5] == [(torch.unsqueeze, (3,), {})] and forms[4] == [(torch.unsqueeze, (-3,), {})]
    # indexing that is not an unsqueeze stays an index
    for fn in (lambda x: x[:, None, 0], lambda x: x[None, None], lambda x: x[:, 1:, None]):
        assert [n.target for n in trace_function(fn).nodes if n.op == "call_function"] == [operator.getitem]


def test_calls_the_canonical_form_cannot_express_keep_their_meaning():
    """`x.div(k, rounding_mode="trunc")` (JetMoE's router: integer token indices) and
    `x.add(y, alpha=2)` have no operator form: they stay as written, and the canonical graph
    computes what the model does (it once became `x / k`, float indices)."""
    class Block(nn.Module):
        def forward(self, idx, x, y):
            return idx.div(2, rounding_mode="trunc"), x.add(y, alpha=2), x.sub(y, alpha=3), x.div(y)

    idx, x, y = torch.arange(9), torch.randn(4), torch.randn(4)
    gm = fx.symbolic_trace(Block())
    canonicalize(gm)
    got, want = gm(idx, x, y), Block()(idx, x, y)
    assert got[0].dtype == torch.int64
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert [n.target for n in gm.graph.nodes if n.op == "call_method"] == ["div", "add", "sub"]
    assert operator.truediv in [n.target for n in gm.graph.nodes]  # the plain division still canonical


def test_numpy_keyword_names_of_builtins_take_torchs_names():
    """torch's builtins take NumPy's `axis`, `keepdims`, `x`, `x1`/`x2` for `dim`, `keepdim`,
    `input`, `other` (ImageGPT's `torch.mean(x, axis=-1, keepdim=True)`): one form with the
    positional call. A Python function's own `axis` keyword stays as written, and so does a call
    that names a parameter twice (it fails as written)."""
    def numpy_names(x):
        return (torch.mean(x, axis=-1, keepdims=True), x.mean(axis=-1, keepdim=True), torch.mul(x1=x, x2=x),
                torch.tanh(x=x), torch.var(x, axis=-1, keepdims=True))

    def torch_names(x):
        return torch.mean(x, -1, True), x.mean(-1, True), x * x, torch.tanh(x), torch.var(x, -1, keepdim=True)

    def own_axis(x, axis=0):
        return x.sum(axis)

    x = torch.randn(3, 5)
    got, want = fx.symbolic_trace(numpy_names), fx.symbolic_trace(torch_names)
    for gm in (got, want):
        canonicalize(gm)
    assert str(_calls(got)) == str(_calls(want))  # nodes by name: the two graphs' own
    for a, b in zip(got(x), torch_names(x)):
        assert torch.equal(a, b)
    g = fx.Graph()
    x_node = g.placeholder("x")
    call = g.call_function(own_axis, (x_node,), {"axis": 1})
    twice = g.call_function(torch.mean, (x_node,), {"dim": -1, "axis": -1})
    g.output((call, twice))
    canonicalize_graph(g)
    assert dict(call.kwargs) == {"axis": 1} and dict(twice.kwargs) == {"dim": -1, "axis": -1}


def test_squares_and_variances_take_one_form_and_compute_the_same():
    """`x.square()`, `torch.square(x)` and a float `x * x` are `pow(x, 2)` (ATen's square, one
    rounding); `var`/`var_mean` in each overload are `(x, dim, correction=c, keepdim=k)`. A bool
    `b * b` stays a product: as a power it would come out int64."""
    class Block(nn.Module):
        def forward(self, x, b):
            return (x.square(), torch.square(x), x * x, b * b, x.var(-1, keepdim=True, unbiased=False),
                    torch.var(x, [-1], False, True), torch.var(x, dim=-1, correction=0, keepdim=True),
                    x.var(), torch.var(x, False), torch.var_mean(x, 0, unbiased=True)[0],
                    x.var(dim=1, correction=2))

    x, b = torch.randn(3, 5), torch.tensor([True, False])
    gm = fx.symbolic_trace(Block())
    from trifuse.fusion.capture import _propagate_fake

    _propagate_fake(gm, [x, b])
    canonicalize(gm)
    calls = _calls(gm)
    assert [c[1:] for c in calls[:4]] == [(torch.pow, (2,), {})] * 3 + [(operator.mul, (calls[3][2][0],), {})]
    variances = [(target, args, kwargs) for _, target, args, kwargs in calls[4:]
                 if target in (torch.var, torch.var_mean)]
    assert variances == [(torch.var, (-1,), {"correction": 0, "keepdim": True})] * 3 + [
        (torch.var, (None,), {"correction": 1, "keepdim": False}),
        (torch.var, (None,), {"correction": 0, "keepdim": False}),
        (torch.var_mean, (0,), {"correction": 1, "keepdim": False}),
        (torch.var, (1,), {"correction": 2, "keepdim": False})]
    for got, want in zip(gm(x, b), Block()(x, b)):
        assert got.dtype == want.dtype and torch.equal(got, want)
    # without example values (fuse's structural search over a throwaway copy) x * x is a power too
    g = fx.symbolic_trace(lambda x: x * x).graph
    canonicalize_graph(g)
    assert [n.target for n in g.nodes if n.op == "call_function"] == [operator.mul]
    squares_as_powers(g)
    assert [n.target for n in g.nodes if n.op == "call_function"] == [torch.pow]


def test_sums_and_two_norms_over_one_dim_take_one_form_and_compute_the_same():
    """`x.sum(d, keepdim=True)` is `torch.sum(x, d, True, dtype=None)` (d as written); the 2-norm
    over one dim in every spelling is `torch.linalg.vector_norm(x, 2, d, keepdim, dtype=None)`.
    Other norms (a 1-norm, the whole tensor's, a matrix norm over two dims) stay as written."""
    class Block(nn.Module):
        def forward(self, x):
            return (x.sum(-1, keepdim=True), torch.sum(x, dim=[0]), x.sum(),
                    x.norm(dim=-1, keepdim=True), torch.norm(x, 2, -1, True), x.norm(p="fro", dim=[1]),
                    torch.linalg.norm(x, dim=-1), torch.linalg.vector_norm(x, ord=2.0, dim=(0,)),
                    x.norm(p=1, dim=-1), x.norm(), torch.linalg.norm(x, ord=2, dim=(0, 1)))

    x = torch.randn(3, 5)
    gm = canonicalize(fx.symbolic_trace(Block()))
    calls = [(target, args, kwargs) for _, target, args, kwargs in _calls(gm)]
    vector_norm = torch.linalg.vector_norm
    assert calls[:3] == [(torch.sum, (-1, True), {"dtype": None}), (torch.sum, ([0], False), {"dtype": None}),
                         (torch.sum, (None, False), {"dtype": None})]
    assert calls[3:8] == [(vector_norm, (2, -1, True), {"dtype": None})] * 2 + [
        (vector_norm, (2, 1, False), {"dtype": None}), (vector_norm, (2, -1, False), {"dtype": None}),
        (vector_norm, (2, 0, False), {"dtype": None})]
    assert calls[8][0] == "norm" and calls[9][0] == "norm" and calls[10][0] is torch.linalg.norm
    for got, want in zip(gm(x), Block()(x)):
        assert torch.equal(got, want)


def test_clamps_from_below_alone_take_one_form_and_compute_the_same():
    """`x.clamp(min=e)`, `torch.clamp(x, e)`, `x.clip(min=e)`, `x.clamp_min(e)` are
    `torch.clamp_min(x, e)`; a clamp with a ceiling stays as written. F.normalize is one call with
    every argument spelled out."""
    class Block(nn.Module):
        def forward(self, x):
            return (x.clamp(min=0.1), torch.clamp(x, 0.1), x.clip(min=0.1), x.clamp_min(0.1),
                    torch.clamp_min(x, min=0.1), torch.clip(x, 0.1, None), x.clamp(max=0.5),
                    x.clamp(0.1, 0.5), F.normalize(x, dim=-1))

    x = torch.randn(3, 5)
    gm = canonicalize(fx.symbolic_trace(Block()))
    calls = [(target, args, kwargs) for _, target, args, kwargs in _calls(gm)]
    assert calls[:6] == [(torch.clamp_min, (0.1,), {})] * 6
    assert [c[0] for c in calls[6:8]] == ["clamp", "clamp"]
    assert calls[8] == (F.normalize, (2.0, -1, 1e-12, None), {})
    for got, want in zip(gm(x), Block()(x)):
        assert torch.equal(got, want)


def test_view_arguments_and_transposes_are_canonical():
    g1 = trace_function(lambda x: x.view(2, -1).transpose(-1, -2))
    g2 = trace_function(lambda x: x.view((2, -1)).transpose(-2, -1))
    assert [n.args[1:] for n in g1.nodes if n.op == "call_method"] == \
        [n.args[1:] for n in g2.nodes if n.op == "call_method"]


def test_fields_of_values_indices_results_become_indices_as_dynamo_writes_them():
    gm = canonicalize(fx.symbolic_trace(lambda x: x - x.max(dim=-1, keepdim=True).values + torch.min(x, 0).indices))
    fields = [n.args[1:] for n in gm.graph.nodes if n.op == "call_function" and n.target is operator.getitem]
    assert fields == [(0,), (1,)]
    x = torch.randn(3, 4)
    torch.testing.assert_close(gm(x), x - x.max(dim=-1, keepdim=True).values + torch.min(x, 0).indices)


def test_one_cast_written_twice_becomes_one_unless_written_in_place():
    def twice(x):  # ModernBERT's rotary: `q.float() * cos + rotate_half(q.float()) * sin`
        return x.float() * 2 + x.float().sin() + x.half()

    def in_place(x):  # two copies, one of them then changed: two values
        a = x.float()
        a.mul_(2)
        return a + x.float()

    def casts(graph):
        return [n.args[1] for n in graph.nodes if n.op == "call_method" and n.target == "to"]

    assert casts(trace_function(twice)) == [torch.float32, torch.float16]
    assert casts(trace_function(in_place)) == [torch.float32, torch.float32]
    x = torch.randn(4, dtype=torch.float16)
    for fn in (twice, in_place):
        graph = trace_function(fn)
        torch.testing.assert_close(fx.GraphModule(nn.Module(), graph)(x), fn(x))


@pytest.mark.parametrize("equation, transposed", [
    ("bhid,bhjd->bhij", True),  # q k^T
    ("bhij,bhjd->bhid", False),  # P v
    ("b h i d, b h j d -> b h i j", True),  # lucidrains-style spaces
    ("bid,bjd->bij", True),  # ldm's CrossAttention on (batch * heads, seq, dim)
    ("bhlk,bhtk->bhlt", True),  # CvT
    ("...id,...jd->...ij", True),
    ("ij,jk->ik", False),
])
def test_einsum_batched_products_become_matmul(equation, transposed):
    letters = equation.replace(" ", "").split("->")[0].split(",")
    a, b = (torch.randn(*[{"b": 2, "h": 3, "i": 4, "j": 5, "k": 6, "d": 6, "l": 4, "t": 5, ".": 1}[c]
                          for c in x.replace("...", ".")]) for x in letters)
    def as_arguments(x, y):
        return torch.einsum(equation, x, y)

    def as_list(x, y):
        return torch.einsum(equation, [x, y])

    for fn in (as_arguments, as_list):
        gm = canonicalize(fx.symbolic_trace(fn))
        calls = [(n.op, n.target) for n in gm.graph.nodes if n.op.startswith("call")]
        assert calls == [*([("call_method", "transpose")] if transposed else []), ("call_function", torch.matmul)]
        torch.testing.assert_close(gm(a, b), torch.einsum(equation, a, b))


@pytest.mark.parametrize("equation", ["ibnd,jbnd->bnij", "bhid,bhjd->bhji", "bhid,bhid->bhi", "bbid,bbjd->bbij",
                                      "bhid,hjd->bhij", "bhid,bhjd", "bhii,bhjd->bhij", "...id,jd->...ij"])
def test_other_einsums_stay(equation):
    """Equations that are not one batched matrix product of two operands in order (XLNet's
    reordered batch, a transposed output, an elementwise product, a repeated letter, a batch dim
    on one side only, an implicit output) keep their einsum."""
    assert _batched_product(equation) is None


def test_casts_either_side_of_a_grad_mode_switch_stay_two():
    """A cast under no_grad does not require grad: Dynamo's graph switches the mode in place
    (`torch._C._set_grad_enabled`), and the cast after the switch must stay its own."""
    def twice(x):
        with torch.no_grad():
            a = x.float() * 2
        return a + x.float()

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(canonicalize(gm))
        return gm

    x = torch.randn(3, dtype=torch.float16, requires_grad=True)
    torch.compile(twice, backend=backend, fullgraph=True)(x).sum().backward()
    assert [n.args[1] for n in graphs[0].graph.nodes if n.target == "to"] == [torch.float32, torch.float32]
    torch.testing.assert_close(x.grad, torch.ones_like(x))


def _dynamo_canonical(fn, *inputs):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(canonicalize(gm))
        return gm

    out = torch.compile(fn, backend=backend, fullgraph=True)(*inputs)
    torch.testing.assert_close(out, fn(*inputs))
    return graphs[0]


def test_interleaved_writes_into_an_empty_like_are_a_stack():
    """Wan's rotary: `out = empty_like(x); out[..., 0::2] = a; out[..., 1::2] = b` becomes
    `stack([a, b], -1).flatten(-2)`, each half cast to out's dtype as its write casts it (float64
    halves into an fp32 out); the values the same (`_dynamo_canonical` runs the canonical graph).
    Left as written: out read between the writes, a half broadcast into its slice, one slice
    written."""
    def written(x, c, kind="both"):
        a, b = x[..., 0::2] * c, x[..., 1::2] - c
        out = torch.empty_like(x)
        out[..., 0::2] = a
        first = out[..., 0::2].sum() if kind == "read_between" else 0.0
        if kind != "one_slice":
            out[..., 1::2] = b[..., :1] if kind == "broadcast" else b
        else:
            out[..., 1::2] = 0.0
        return out * 3 + first

    x = torch.randn(3, 5, 8)
    for c in (torch.randn(4), torch.randn(4, dtype=torch.float64)):
        graph = _dynamo_canonical(written, x, c).graph
        assert not [n for n in graph.nodes if n.target in (torch.empty_like, operator.setitem)]
        stack = next(n for n in graph.nodes if n.target is torch.stack)
        casts = [n for n in stack.args[0] if n.target == "to"]
        assert len(casts) == (2 if c.dtype == torch.float64 else 0)
    for kind in ("read_between", "broadcast", "one_slice"):
        graph = _dynamo_canonical(functools.partial(written, kind=kind), x, torch.randn(4)).graph
        assert [n for n in graph.nodes if n.target is torch.empty_like], kind
        assert not [n for n in graph.nodes if n.target is torch.stack], kind


def test_an_update_of_a_fresh_result_is_out_of_place_rounded_where_it_promotes():
    """MPNet's `scores += position_bias`: on a fresh product read by nothing else, `a + b`; where
    the sum promotes (fp16 scores, an fp32 bias: autocast's mix), what the update stores,
    `(a + b).to(fp16)`, its readers reading the cast; any other update stays as written.
    Values unchanged (an fp16 result either way)."""
    def fresh(q, k, bias):
        s = torch.matmul(q, k) / 2
        s += bias
        return s * 3

    def not_fresh(q, bias):  # a clone: not a fresh result of the kinds the update may stand for
        s = q.clone()
        s += bias
        return s * 3

    q, k = torch.randn(2, 4, 4, dtype=torch.float16), torch.randn(2, 4, 4, dtype=torch.float16)
    for bias in (torch.randn(4, 4, dtype=torch.float16), torch.randn(4, 4)):
        graph = _dynamo_canonical(fresh, q, k, bias).graph
        updates = [n for n in graph.nodes if n.target in (operator.iadd, operator.add)]
        assert [n.target for n in updates] == [operator.add]
        casts = [n for n in graph.nodes if n.target == "to"]
        rounded = bias.dtype == torch.float32
        assert [n.args for n in casts] == ([(updates[0], torch.float16)] if rounded else [])
        graph = _dynamo_canonical(not_fresh, q, bias).graph
        assert [n.target for n in graph.nodes if n.target in (operator.iadd, operator.add)] == [operator.iadd]


def test_a_view_there_and_back_is_dropped():
    """XGLM's `w.view(B, H, S, S).view(B * H, S, S)` after its softmax reads the softmax itself;
    the first view stays where something else reads it, and a chain ending in another shape or
    written to in place stays as written."""
    def round_trip(x):
        return x.softmax(-1).view(2, 3, 4, 4).view(6, 4, 4) * 2

    def round_trip_read_twice(x):
        w = x.softmax(-1).view(2, 3, 4, 4)
        return w.view(6, 4, 4) * 2, w

    def other_shape(x):
        return x.softmax(-1).view(2, 3, 4, 4).view(6, 16) * 2

    def written_in_place(x):
        w = x.softmax(-1).view(2, 3, 4, 4).view(6, 4, 4)
        w.mul_(2)
        return w

    x = torch.randn(6, 4, 4)
    views = {fn.__name__: [n.args[1] for n in _dynamo_canonical(fn, x).graph.nodes if n.target == "view"]
             for fn in (round_trip, round_trip_read_twice, other_shape, written_in_place)}
    assert views == {"round_trip": [], "round_trip_read_twice": [(2, 3, 4, 4)],
                     "other_shape": [(2, 3, 4, 4), (6, 16)], "written_in_place": [(2, 3, 4, 4), (6, 4, 4)]}


def test_a_softmax_of_a_cast_takes_the_dtype_and_expand_as_a_static_shape():
    """`softmax(x.float())` is softmax's dtype form (the cast stays for its other readers; where it
    is written in place, the softmax reads it as written); `m.expand_as(x)` becomes
    `m.expand(<x's shape>)` where Dynamo's example values give x a static shape, so the mask no
    longer reads x. Values unchanged."""
    def upcast(x, m):
        s = x * 2
        return torch.softmax(s.float(), dim=-1).type_as(s) + (m == 0).expand_as(s)

    def cast_read_twice(x, m):
        f = x.float()
        return torch.softmax(f, -1) + f

    def cast_written(x, m):
        f = x.float()
        f.mul_(2)
        return torch.softmax(f, -1)

    x, m = torch.randn(2, 3, 4, dtype=torch.float16), torch.ones(2, 1, 4)
    graphs = {fn.__name__: _dynamo_canonical(fn, x, m).graph
              for fn in (upcast, cast_read_twice, cast_written)}
    softmax_dtypes = {name: [n.args[2] for n in g.nodes if n.target is torch.softmax]
                      for name, g in graphs.items()}
    assert softmax_dtypes == {"upcast": [torch.float32], "cast_read_twice": [torch.float32],
                              "cast_written": [None]}
    casts = {name: sum(n.target == "to" for n in g.nodes) for name, g in graphs.items()}
    assert casts == {"upcast": 1, "cast_read_twice": 1, "cast_written": 1}  # upcast's: type_as
    expands = [(n.target, n.args[1:]) for n in graphs["upcast"].nodes if n.target in ("expand", "expand_as")]
    assert expands == [("expand", ((2, 3, 4),))]
    # an fx capture serves every size of its key: its graph keeps expand_as, example values or not
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp
    gm = fx.symbolic_trace(upcast)
    FakeTensorProp(gm).propagate(x, m)
    assert [n.target for n in canonicalize(gm).graph.nodes if n.op == "call_method"].count("expand_as") == 1
    x2, m2 = torch.randn(3, 5, 4, dtype=torch.float16), torch.ones(3, 1, 4)
    torch.testing.assert_close(gm(x2, m2), upcast(x2, m2))


def test_view_as_and_reshape_as_a_static_shape_read_no_value():
    """`b.reshape_as(s)` and `b.view_as(s)` (SAM's relative-position bias shaped to the scores)
    become `reshape` / `view` to s's static shape in a Dynamo graph: s then feeds only the sum.
    Values unchanged."""
    def bias_shaped_to_scores(x, b):
        s = x * 2
        return s + b.reshape_as(s) + b.contiguous().view_as(s)

    x, b = torch.randn(2, 3, 4), torch.randn(6, 4)
    graph = _dynamo_canonical(bias_shaped_to_scores, x, b).graph
    shaped = [(n.target, n.args[1:]) for n in graph.nodes
              if n.op == "call_method" and n.target != "contiguous"]
    assert shaped == [("reshape", ((2, 3, 4),)), ("view", ((2, 3, 4),))]
    scores = next(n for n in graph.nodes if n.target is operator.mul)
    assert [u.target for u in scores.users] == [operator.add]


def test_a_softmax_of_a_cast_to_16_bits_takes_the_dtype_only_where_it_computes_in_it():
    """`softmax(x.half())` is `softmax(x, dtype=half)` where the softmax's result is fp16 (its
    example value says so); CUDA autocast computes the first in fp32 and the second in fp16, so a
    softmax whose value is fp32 keeps its cast, as does one without example values."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    def downcast(x):
        return torch.softmax(x.half(), -1)

    def softmax_dtype(gm):
        return [n.args[2] for n in canonicalize(gm).graph.nodes if n.target is torch.softmax]

    x = torch.randn(2, 4)
    assert softmax_dtype(fx.symbolic_trace(downcast)) == [None]  # no example values
    gm = fx.symbolic_trace(downcast)
    FakeTensorProp(gm).propagate(x)
    assert softmax_dtype(gm) == [torch.float16]
    torch.testing.assert_close(gm(x), downcast(x))
    gm = fx.symbolic_trace(downcast)
    FakeTensorProp(gm).propagate(x)
    softmax = next(n for n in gm.graph.nodes if n.target in (torch.softmax, F.softmax, "softmax"))
    softmax.meta["val"] = softmax.meta["val"].float()  # as traced under CUDA autocast
    assert softmax_dtype(gm) == [None]


def test_a_softmax_in_its_inputs_own_dtype_is_the_plain_softmax_unless_cast_after():
    """`softmax(x, dtype=<x's dtype>)` (Falcon's `dtype=hidden_states.dtype`) computes what
    `softmax(x)` does: the dtype goes, where example values show it; a softmax cast after keeps it
    (Llama's upcast spelling, `softmax(x, dtype=float32).to(q.dtype)`), as does one in another dtype."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    def model(x):
        return (torch.softmax(x, -1, torch.float32), torch.softmax(x, -1, torch.float32).to(torch.float16),
                torch.softmax(x, -1, torch.float64))

    x = torch.randn(2, 4)
    gm = fx.symbolic_trace(model)
    dtypes = [n.args[2] for n in canonicalize(gm).graph.nodes if n.target is torch.softmax]
    assert dtypes == [torch.float32, torch.float32, torch.float64]  # no example values: kept
    gm = fx.symbolic_trace(model)
    FakeTensorProp(gm).propagate(x)
    gm = canonicalize(gm)
    dtypes = [n.args[2] for n in gm.graph.nodes if n.target is torch.softmax]
    assert dtypes == [None, torch.float32, torch.float64]
    for a, b in zip(gm(x), model(x)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_baddbmm_over_fresh_zeros_is_a_scaled_bmm():
    """`baddbmm(zeros, a, b, beta, alpha)` -> `bmm(a, b) * alpha`; zeros read elsewhere too, or a
    start that is not zeros, keep the baddbmm."""
    def model(a, b, c):  # zeros_like of an input: fx keeps it a node (torch.zeros of constants it runs)
        over_zeros = torch.baddbmm(torch.zeros_like(c), a, b, beta=1.0, alpha=0.5)
        shared = torch.zeros_like(c)
        kept = torch.baddbmm(shared, a, b, alpha=0.5) + shared
        return over_zeros, kept, torch.baddbmm(torch.ones_like(c), a, b, alpha=0.5)

    gm = canonicalize(fx.symbolic_trace(model))
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.bmm) == 1 and targets.count(torch.baddbmm) == 2
    a, b, c = torch.randn(2, 3, 4), torch.randn(2, 4, 5), torch.randn(2, 3, 5)
    for x, y in zip(gm(a, b, c), model(a, b, c)):
        torch.testing.assert_close(x, y)


def test_match_is_by_dataflow_not_order_and_either_way_round():
    cp = compile_pattern(next(p for p in dropout_add.PATTERNS if p.name == "dropout_add"))

    def model(x, r, other):
        unrelated = other * 3  # statements in between, and the add written the other way round
        d = F.dropout(x, 0.1, True, False)
        z = unrelated.sin()
        return d + r, z

    graph = trace_function(model)
    add = next(n for n in graph.nodes if n.target is operator.add)
    found = list(matches(cp, add))
    assert len(found) == 1
    assert found[0]["residual"].name == "r" and found[0]["p"] == 0.1 and found[0]["training"] is True


def test_a_placeholder_matches_the_same_value_everywhere():
    cp = compile_pattern(next(p for p in bias_gelu.PATTERNS if p.name == "gelu_tanh_written_out"))

    def almost(x, y):  # the cube of another tensor: not GeLU
        return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * torch.pow(y, 3.0))))

    graph = trace_function(almost)
    assert not any(list(matches(cp, n)) for n in graph.nodes)


def test_a_tensor_parameter_does_not_match_a_constant():
    cp = compile_pattern(next(p for p in dropout_add.PATTERNS if p.name == "dropout_add"))
    graph = trace_function(lambda x: F.dropout(x, 0.1, True, False) + 1.0)
    assert not any(list(matches(cp, n)) for n in graph.nodes)


def test_rewrite_of_a_traced_graph_module():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(8)

        def forward(self, x):
            return self.ln(x) + 1

    m = M()
    gm = canonicalize(fx.symbolic_trace(m), m)
    log = rewrite(gm, layer_norm.PATTERNS)
    assert log.counts == {"layer_norm": 1} and log.by_pattern == {"layer_norm": 1}
    x = torch.randn(3, 8)
    torch.testing.assert_close(gm(x), m(x))


def test_a_filter_that_raises_rejects_its_match_alone():
    """A filter's own bug (NeoMMe's 0-dim x once met `x.shape[-1]` in a residual-stream check)
    rejects that match with the error as its reason; the graph's other matches still fuse (before,
    the whole capture ran unfused)."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.LayerNorm(8), nn.LayerNorm(8)

        def forward(self, x):
            return self.a(x) + self.b(x)

    def picky(m):
        if m["weight"].target.startswith("b"):
            raise IndexError("tuple index out of range")
        return None

    patterns = [Pattern("layer_norm", "layer_norm", layer_norm.layer_norm, layer_norm.layer_norm_fused,
                        ("layer_norm",), (picky,))]
    m = M()
    gm = canonicalize(fx.symbolic_trace(m), m)
    x = torch.randn(3, 8)
    log = rewrite(gm, patterns)
    assert log.counts == {"layer_norm": 1}
    assert [r.reason for r in log.rejected] == [
        "the check picky failed on this match (IndexError: tuple index out of range)"]
    torch.testing.assert_close(gm(x), m(x))


def test_a_bad_pattern_is_refused():
    def returns_its_input(x):
        return x.sin(), x

    bad = Pattern("returns_its_input", "layer_norm", returns_its_input, returns_its_input, ())
    try:
        compile_pattern(bad)
    except ValueError as e:
        assert "every output must be computed" in str(e)
    else:
        raise AssertionError("a pattern returning one of its inputs must be refused")


def _two_sinks(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, half):
    return a[..., :half] * c, b[..., :half] * c


def test_a_pattern_with_two_sinks_matches_both_with_shared_bindings():
    """Outputs that do not feed each other (rotary q and k) are matched together: the second at a
    node of its target anywhere in the graph, with the bindings of the first (one c, one half);
    slice bounds bind like any placeholder."""

    def model(x, y, z, w):
        return x[..., :2] * z, y[..., :2] * z, x[..., :3] * w

    gm = canonicalize(fx.symbolic_trace(model))
    cp = compile_pattern(Pattern("two_sinks", "layer_norm", _two_sinks, _two_sinks, ()))
    found = [m for n in gm.graph.nodes for m in matches(cp, n)]
    assert {(m["a"].name, m["b"].name, m["c"].name, m["half"]) for m in found} == {
        ("x", "y", "z", 2), ("y", "x", "z", 2)}
    assert all(len(m.outputs) == 2 and len(set(m.nodes)) == 4 for m in found)


def test_dead_view_chains_are_dropped_whole_and_nothing_else():
    """What a block computes and drops (WavLM's attention probabilities, unsqueezed and broadcast
    for an output nobody reads) goes, chain and all, in one pass; an unused op that is not a view
    (a softmax) and everything the output reads stay."""
    from trifuse.fusion.rewriter import _drop_dead_reads

    def f(x):
        pair = torch.softmax(x, -1), x.relu()
        pair[1].unsqueeze(1).broadcast_to(2, 3, 4, 5).transpose(0, 1)  # read by nobody
        torch.softmax(x, 0)  # not a view: kept
        return pair[0].view(2, 20)

    gm = fx.symbolic_trace(f)
    before = [n.target for n in gm.graph.nodes]
    _drop_dead_reads(gm.graph)
    after = [n.target for n in gm.graph.nodes]
    assert {"unsqueeze", "broadcast_to", "transpose"} <= set(before)
    assert not {"unsqueeze", "broadcast_to", "transpose"} & set(after)
    assert after.count(torch.softmax) == 2 and "relu" in after and "view" in after
    x = torch.randn(2, 4, 5)
    gm.recompile()
    torch.testing.assert_close(gm(x), f(x))
