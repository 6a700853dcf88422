"""relprop.ops: the op registry is strict, each family makes calls of its kind with their fields declared."""
import math

import pytest
import torch
import torch.nn.functional as F

import relprop
from relprop import ops
from relprop._core import registry
from relprop.ops import linear
from relprop.rules import OpKind
from relprop.engine import AddCall, OpCall


def test_registering_a_name_this_torch_lacks_raises_and_names_it():
    with pytest.raises(AttributeError, match=r"torch\.no_such_op, which torch .* does not have"):
        registry.lookup(torch, "relu no_such_op")
    with pytest.raises(AttributeError, match=r"Tensor\.cat"):  # torch.cat has no Tensor method
        registry.torch_and_tensor("cat")


def test_names_of_some_torch_versions_only_are_registered_where_they_exist():
    for name in registry.OPTIONAL:
        namespace, _, attribute = name.rpartition(".")
        func = getattr({"torch": torch, "torch.nn.functional": F}[namespace], attribute, None)
        assert func is None or func in ops.HANDLERS, name


def test_every_registered_function_of_torch_and_tensor_exists_once_per_namespace():
    # the shared lists register both namespaces: an op of both is handled alike in both
    for func in (torch.reshape, torch.Tensor.reshape, torch.add, torch.Tensor.add, torch.Tensor.__radd__,
                 torch.rsub, torch.Tensor.pow_, torch.relu_, torch.Tensor.relu_, torch.get_device):
        assert func in ops.HANDLERS
    assert ops.HANDLERS[torch.mul] is ops.HANDLERS[torch.Tensor.mul]
    assert ops.HANDLERS[torch.sigmoid] is ops.HANDLERS[torch.Tensor.sigmoid]


def test_op_kinds_are_strings():
    assert OpKind.CONV == "conv" and OpKind.PRODUCT in frozenset({"product"}) and f"{OpKind.SUM}" == "sum"
    assert {"maxpool": 1}[OpKind.MAXPOOL] == 1


def _activation(*shape):
    return torch.randn(*shape, requires_grad=True)


def test_a_product_declares_its_factors_from_their_tags():
    x, gate = _activation(2, 3), _activation(2, 3)
    tags = {id(gate): "sigmoid"}
    call = ops.ProductCall(torch.mul, (x, gate), {}, "block", False, False, lambda t: tags.get(id(t)))
    assert call.kind == OpKind.PRODUCT and call.factors == (None, "sigmoid") and not call.matrix
    assert call.scaled is None and call.module_name == "block" and call.name == "torch.mul"


def test_a_division_makes_its_divisor_a_gate_and_keeps_the_numerator_tag():
    x, y = _activation(2, 3), _activation(2, 3)
    call = ops.ProductCall(torch.div, (x, y), {}, "", False, True, lambda t: "softmax" if t is x else None)
    assert call.factors == (None, "divisor") and call.scaled == "softmax"


def test_a_matrix_product_with_one_activation_is_a_linear_map():
    x = _activation(2, 3)
    call = ops.ProductCall(torch.matmul, (x, torch.randn(3, 4)), {}, "", True, False, lambda t: None)
    assert call.kind == OpKind.SUM and call.matrix and call.factors == ()


def test_an_activation_scaled_by_a_number_passes_and_keeps_its_tag():
    x = _activation(2, 3)
    call = ops.ProductCall(torch.mul, (x, 30.0), {}, "", False, False, lambda t: "sigmoid")
    assert call.factors == (None,) and call.scaled == "sigmoid"
    gated = ops.ProductCall(torch.mul, (x, torch.randn(2, 3)), {}, "", False, False, lambda t: "sigmoid")
    assert gated.factors == ("sigmoid",) and gated.scaled is None  # a gate on a constant signal


def test_softmax_and_max_pooling_calls_carry_their_fields():
    x = _activation(1, 1, 4, 4)
    softmax = ops.SoftmaxCall(torch.softmax, (x, -1), {}, "attn", -1)
    assert softmax.kind == OpKind.SOFTMAX and softmax.dim == -1

    def average(t):
        return F.avg_pool2d(t, 2)

    pool = ops.MaxPoolCall(F.max_pool2d, (x, 2), {}, "pool", average)
    assert pool.kind == OpKind.MAXPOOL and pool.average is average


def test_fields_of_other_kinds_have_declared_defaults():
    call = OpCall(OpKind.ELEMENTWISE, torch.tanh, (_activation(3),), {}, "torch.tanh", "")
    assert (call.is_first, call.factors, call.matrix, call.in_place, call.overwrites, call.kept_output) == (
        False, (), False, False, None, None)
    with pytest.raises(RuntimeError, match="reads call.prepared, but its prepare returned nothing"):
        call.prepared  # nothing prepared it: a rule that reads it is told so


@pytest.mark.parametrize("func, names, kwargs, factors", [
    (torch.add, ("a", "b"), {}, (1, 1)),
    (torch.Tensor.add, ("a", "row"), {}, (1, 1)),  # the second input broadcast: its gradient summed to its shape
    (torch.sub, ("row", "a"), {"alpha": 0.3}, (1, -0.3)),
    (torch.Tensor.sub, ("c", "a"), {}, (-1,)),  # a constant first: one activation, negated
    (torch.add, ("a", 2.5), {"alpha": 3}, (1,)),
])
def test_a_sum_has_the_closed_form_vjp_of_autograd_bitwise(func, names, kwargs, factors):
    torch.manual_seed(0)
    tensors = {"a": _activation(2, 3).double(), "b": _activation(2, 3).double(), "row": _activation(3).double(),
               "c": torch.randn(2, 3, dtype=torch.float64)}
    values = tuple(tensors.get(name, name) for name in names)
    sign = -1 if func in (torch.sub, torch.Tensor.sub) else 1
    call = AddCall(func, values, kwargs, "add", "", sign * kwargs.get("alpha", 1))
    assert call._factors == factors and not call._needs_graph()
    grad = torch.randn(2, 3, dtype=torch.float64)
    activations = [v for v in values if isinstance(v, torch.Tensor) and v.requires_grad]
    expected = torch.autograd.grad(func(*values, **kwargs), activations, grad)
    found = call.vjp(grad)
    assert len(found) == len(expected)
    for x, e, f in zip(activations, expected, found):
        assert f.shape == x.shape and torch.equal(e, f)


def test_sums_of_mixed_dtypes_keep_autograd_for_their_vjp():
    a = _activation(2, 3)
    with relprop.LRP(torch.nn.Identity().eval()).context() as session:
        mixed = session.aliases.producer(a + a.double())
        same = session.aliases.producer(a + 1)
    assert type(mixed) is OpCall and mixed._graph is not None
    assert type(same) is AddCall and same._graph is None


@pytest.mark.parametrize("func, names", [
    (torch.mul, ("a", "b")), (torch.Tensor.mul, ("a", "row")), (torch.multiply, ("row", "a")), (torch.mul, ("a", "a")),
    (torch.Tensor.mul, ("a", 0.3)),
])
def test_an_elementwise_product_has_the_closed_form_vjp_of_autograd_bitwise(func, names):
    torch.manual_seed(0)
    tensors = {"a": _activation(2, 3).double(), "b": _activation(2, 3).double(), "row": _activation(3).double(),
               "c": torch.randn(2, 3, dtype=torch.float64)}
    values = tuple(tensors.get(name, name) for name in names)
    call = ops.ProductCall(func, values, {}, "", False, False, lambda t: None)
    assert not call._needs_graph()
    grad = torch.randn(2, 3, dtype=torch.float64)
    # as the graph kept from the forward pass had it: one leaf per activation argument (``a * a`` has two)
    leaves = tuple(v.detach().requires_grad_() if isinstance(v, torch.Tensor) and v.requires_grad else v
                   for v in values)
    activations = [v for v in leaves if isinstance(v, torch.Tensor) and v.requires_grad]
    expected = torch.autograd.grad(func(*leaves), activations, grad)
    found = call.vjp(grad)
    assert len(found) == len(expected)
    for x, e, f in zip(activations, expected, found):
        assert f.shape == x.shape and torch.equal(e, f)


def test_products_of_other_forms_keep_autograd_for_their_vjp():
    # mixed dtypes, a constant tensor (autograd notices if it is modified in place before the backward pass),
    # divisions, matrix products
    a, b = _activation(2, 3), _activation(2, 3)
    for call in (ops.ProductCall(torch.mul, (a, b.double()), {}, "", False, False, lambda t: None),
                 ops.ProductCall(torch.mul, (a, torch.randn(2, 3)), {}, "", False, False, lambda t: None),
                 ops.ProductCall(torch.div, (a, b), {}, "", False, True, lambda t: None),
                 ops.ProductCall(torch.matmul, (a, b.T), {}, "", True, False, lambda t: None)):
        call.rule = relprop.rules.Epsilon()
        assert call._needs_graph()


class _DenseByHand(torch.nn.Module):
    """nn.Linear's weights applied as ``x @ W.T`` (and ``torch.mm``, ``torch.matmul``) in the forward pass."""

    def __init__(self, linear: torch.nn.Sequential, product):
        super().__init__()
        self.linear, self.product = linear, product

    def forward(self, x):
        h = torch.relu(self.product(x, self.linear[0].weight.T))
        return self.product(h, self.linear[2].weight.T)


@pytest.mark.parametrize("product", [torch.matmul, torch.mm, lambda a, b: a @ b], ids=["matmul", "mm", "operator"])
@pytest.mark.parametrize("rule", [relprop.rules.ZPlus(), relprop.rules.AlphaBeta(2, 1), relprop.rules.Gamma(0.25),
                                  relprop.rules.Epsilon(0.1)], ids=repr)
def test_a_dense_layer_written_as_a_matrix_product_gets_the_dense_rule(product, rule):
    torch.manual_seed(0)
    linear = torch.nn.Sequential(torch.nn.Linear(5, 7, bias=False), torch.nn.ReLU(),
                                 torch.nn.Linear(7, 3, bias=False)).double().eval()
    x = torch.randn(4, 5, dtype=torch.float64)
    composite = relprop.Composite(dense=rule)
    expected = relprop.LRP(linear, composite).attribute(x, target=1)
    # the same rule; its modified forward (z+, for one) runs as `x @ C` here and as F.linear there: BLAS may sum
    # their products in another order, so equal to rounding in float64, not always bitwise
    torch.testing.assert_close(relprop.LRP(_DenseByHand(linear, product).eval(), composite).attribute(x, target=1),
                               expected, rtol=1e-12, atol=1e-12)


def test_a_constant_matrix_on_the_left_stays_a_linear_map_of_the_sum_kind():
    x = _activation(3, 4)
    with relprop.LRP(torch.nn.Identity().eval()).context() as session:
        call = session.aliases.producer(torch.randn(2, 3) @ x)
        dense = session.aliases.producer(x.T @ torch.randn(3, 2))
    assert call.kind == OpKind.SUM and dense.kind == OpKind.DENSE


def test_the_rows_that_hold_relevance_count_nan_and_infinities_and_not_negative_zero():
    from relprop._core.tensors import held_rows

    grad = torch.zeros(2, 5, 3)
    grad[0, 1, 2], grad[1, 0, 0], grad[1, 3, 1], grad[0, 4, 0] = math.nan, -math.inf, -2.0, -0.0
    assert held_rows(grad).tolist() == [1, 5, 8]
    assert held_rows(grad[:, :4]).tolist() == [1, 4, 7]  # 3 rows of 8, strided
    grad[:, :2] = 1.0  # 5 rows of 10: at most half
    assert held_rows(grad).tolist() == [0, 1, 5, 6, 8]
    grad[0, 2] = 1.0  # 6 rows of 10: too many to skip the others
    assert held_rows(grad) is None
    assert held_rows(torch.tensor(1.0)) is None and held_rows(torch.zeros(4)) is None
    assert held_rows(torch.zeros(0, 3)) is None and held_rows(torch.zeros(3, 0)) is None


def _sparse_forms(monkeypatch):
    """A list that records each sparse form ``ops.dense_transpose`` takes from now on, with the number of rows
    (``index_copy_`` of the product of those rows) or columns (``index_select`` of the weight rows they select)
    it multiplies."""
    taken = []
    original_copy, original_select = torch.Tensor.index_copy_, torch.Tensor.index_select
    monkeypatch.setattr(torch.Tensor, "index_copy_", lambda self, dim, index, source:
                        taken.append(("rows", index.numel())) or original_copy(self, dim, index, source))
    monkeypatch.setattr(torch.Tensor, "index_select", lambda self, dim, index:
                        (dim == 0 and taken.append(("columns", index.numel()))) or original_select(self, dim, index))
    return taken


def _spied_dense_transpose(grad, weight, monkeypatch):
    """``ops.dense_transpose(grad, weight)`` and the sparse forms it took (:func:`_sparse_forms`)."""
    taken = _sparse_forms(monkeypatch)
    return ops.dense_transpose(grad, weight), taken


def test_a_dense_transposed_product_of_relevance_in_a_few_rows_multiplies_those_rows_alone(monkeypatch):
    torch.manual_seed(0)
    weight = torch.randn(4096, 256, dtype=torch.float64)
    grad = torch.zeros(2, 64, 4096, dtype=torch.float64)
    grad[0, 3] = torch.randn(4096, dtype=torch.float64)  # two tokens carry relevance (BERT's [CLS] carries all)
    grad[1, 63, :7] = torch.randn(7, dtype=torch.float64)
    grad[1, 5, 9] = -0.0  # a zero all the same
    result, taken = _spied_dense_transpose(grad, weight, monkeypatch)
    assert taken == [("rows", 2)]
    assert result[0, :3].eq(0).all() and result[1, :63].eq(0).all()
    # each row bitwise as in the product of the rows that hold relevance
    assert torch.equal(result.view(-1, 256)[[3, 127]], grad.view(-1, 4096)[[3, 127]] @ weight)
    torch.testing.assert_close(result, grad @ weight, rtol=0, atol=1e-12)


@pytest.mark.parametrize("nonzeros_per_row", [1, 3])
def test_a_dense_transposed_product_of_few_columns_in_many_rows_multiplies_the_weight_rows_they_select(
        nonzeros_per_row, monkeypatch):
    torch.manual_seed(0)
    weight = torch.randn(40000, 64, dtype=torch.float64)
    grad = torch.zeros(1, 8, 40000, dtype=torch.float64)  # every token holds a few entries (one logit each)
    for token in range(8):
        grad[0, token, torch.randperm(40000)[:nonzeros_per_row]] = torch.randn(nonzeros_per_row, dtype=torch.float64)
    columns = grad[0].ne(0).any(0).sum().item()
    result, taken = _spied_dense_transpose(grad, weight, monkeypatch)
    assert taken == [("columns", columns)]
    expected = grad @ weight
    if nonzeros_per_row == 1:  # one row of the weight, scaled, plus zeros: bitwise the dense product
        assert torch.equal(result, expected)
    torch.testing.assert_close(result, expected, rtol=0, atol=1e-12)


def test_a_dense_transposed_product_of_dense_or_small_relevance_is_the_plain_product(monkeypatch):
    torch.manual_seed(0)
    weight, dense = torch.randn(4096, 64), torch.randn(64, 4096)
    dense[:, ::2] = 0  # half the entries of every row nonzero, in half the columns: neither sparse form pays
    result, taken = _spied_dense_transpose(dense, weight, monkeypatch)
    assert taken == [] and torch.equal(result, dense @ weight)
    small = torch.zeros(4, 4096)
    small[0, 3] = 1.0  # sparse, but a product of 1 million multiply-adds: checking would cost more than it saves
    assert small.numel() * weight.shape[1] < linear.SPARSE_PRODUCT_SIZE
    result, taken = _spied_dense_transpose(small, weight, monkeypatch)
    assert taken == [] and torch.equal(result, small @ weight)


@pytest.mark.parametrize("rows", [1, 64], ids=["rows", "columns"])
def test_nan_in_a_dense_transposed_product_reaches_its_row_as_in_the_dense_product(rows, monkeypatch):
    weight = torch.randn(4096, 64)
    nan = torch.zeros(64, 4096)
    nan[:rows, 7] = 1.0  # one row (its rows multiplied) or every row (the one column multiplied)
    nan[0, 0] = math.nan  # counted as relevance: it reaches the result as in the dense product
    result, taken = _spied_dense_transpose(nan, weight, monkeypatch)
    assert taken == ([("rows", 1)] if rows == 1 else [("columns", 2)])
    assert torch.isnan(result[0]).all() and not torch.isnan(result[1:]).any()
    torch.testing.assert_close(result[1:], nan[1:] @ weight, rtol=0, atol=1e-5)


def test_the_language_model_head_of_a_llama_hands_on_relevance_through_its_sparse_form_exactly(monkeypatch):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config).double().eval()
    ids = torch.randint(0, 32000, (1, 12))
    lrp = relprop.LRP(model, "attnlrp")
    sparse = lrp.attribute(ids, target=(-1, 42))
    monkeypatch.setattr(linear, "SPARSE_PRODUCT_SIZE", 1 << 62)  # every transposed product dense
    dense = lrp.attribute(ids, target=(-1, 42))
    assert sparse.abs().sum() > 0
    torch.testing.assert_close(sparse, dense, rtol=0, atol=1e-12)


@pytest.mark.parametrize("rule", [relprop.rules.Epsilon(1e-6), relprop.rules.ZPlus(), relprop.rules.AlphaBeta(2, 1),
                                  relprop.rules.Gamma(0.25), relprop.rules.Flat()], ids=repr)
def test_every_dense_rule_takes_the_sparse_transposed_product_to_float64_rounding(rule, monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 40000)).double()
    x = torch.randn(3, 64, dtype=torch.float64)  # three examples, one logit each: 3 of 120000 entries nonzero
    lrp = relprop.LRP(model.eval(), relprop.Composite(dense=rule))
    taken = _sparse_forms(monkeypatch)
    sparse = lrp.attribute(x, target=[5, 17, 39999])
    # the head's products: the 3 weight rows the logits select (each example's row holds relevance)
    assert taken and all(form == ("columns", 3) for form in taken)
    monkeypatch.setattr(linear, "SPARSE_PRODUCT_SIZE", 1 << 62)
    dense = lrp.attribute(x, target=[5, 17, 39999])
    assert dense.abs().sum() > 0
    torch.testing.assert_close(sparse, dense, rtol=0, atol=1e-12)
