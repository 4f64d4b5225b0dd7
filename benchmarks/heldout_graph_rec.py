"""Held-out probe workloads for ``benchmarks/fidelity.py --workload`` from three packages the
corpus, the zoo and the other probes never use. ``jraph_gnn``: a jraph graph network over a batch
of 4 graphs joined by ``jraph.batch_np`` (64 nodes, 256 edges, 16 node and 4 edge features, a
global per graph): a ``jraph.GraphConvolution`` (``segment_sum`` of gathered senders, degree
normalisation), a ``jraph.GAT`` layer (``segment_softmax``: ``segment_max`` then ``segment_sum``)
and a ``jraph.GraphNetwork`` with edge, node and global updates (``jnp.repeat`` of the globals
over ``n_node`` / ``n_edge``, ``segment_max`` of the edges into nodes), each update a flax linen
``nn.Dense`` MLP; loss: node classification (8 classes) plus a per-graph regression on the
globals. ``griffin``: recurrentgemma's ``Griffin`` (``recurrentgemma.jax``), randomly initialised
from a tiny ``GriffinConfig``: width 32, 4 heads, blocks recurrent, recurrent, local attention
(window 8) with the RG-LRU run by its native ``lax.scan``, its block-diagonal gate einsums and
causal ``Conv1D``; without its own gradient checkpointing (``gradient_checkpointing=False``);
next-token loss over tokens (8, 16) of vocab 64. ``penzai_lm``: penzai's llama-like transformer
(``penzai.models.transformer.variants.llamalike_common.build_llamalike_transformer``: named-axis
``pz`` layers, grouped-query attention with 2 KV heads x 2 queries, RoPE, SwiGLU, RMSNorm), 2
blocks of width 32, converted to a function of a params pytree as penzai documents
(``pz.unbind_params(model, freeze=True)``, ``pz.bind_variables`` inside the loss); next-token
loss over tokens (8, 16) of vocab 64. AdamW via the zoo's train step. None of the three packages
is a project dependency: run with ``PYTHONPATH=<repo>:/work/probe_site`` (or pip install jraph,
recurrentgemma, penzai).

    python benchmarks/fidelity.py --episodes 16 --workload benchmarks/heldout_graph_rec.py:jraph_gnn \\
        --workload benchmarks/heldout_graph_rec.py:griffin --workload benchmarks/heldout_graph_rec.py:penzai_lm
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax

from automap.zoo.train import make_workload

B, T, V, C = 8, 16, 64, 8
GRAPHS, NODES, EDGES, NODE_FEATURES, EDGE_FEATURES, H = 4, 16, 64, 16, 4, 32  # per graph; 64 nodes, 256 edges


def _fill(names, leaf, rng):
    if names[-1] == "scale" or (len(names) > 1 and names[-2] == "scale"):
        return np.ones(leaf.shape, leaf.dtype)
    return (rng.normal(size=leaf.shape) * 0.1).astype(leaf.dtype)


def _token_batch():
    return {"tokens": jax.ShapeDtypeStruct((B, T), jnp.int32)}


def _tokens(seed):
    return {"tokens": np.random.default_rng(seed).integers(0, V, (B, T)).astype(np.int32)}


def _next_token_loss(logits, tokens):
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()


def _lm_workload(name, params_shape, loss_fn):
    return make_workload(name, None, loss_fn=loss_fn, abstract_params=lambda: params_shape, fill_param=_fill,
                         abstract_batch=_token_batch, make_batch=_tokens, learning_rate=1e-3)


# --- jraph_gnn -------------------------------------------------------------------------------------


def _graphs(seed):
    """4 random graphs of 16 nodes and 64 edges joined by ``jraph.batch_np``, node labels and a
    target per graph."""
    import jraph

    rng = np.random.default_rng(seed)
    graphs = [jraph.GraphsTuple(
        nodes=rng.normal(size=(NODES, NODE_FEATURES)).astype(np.float32),
        edges=rng.normal(size=(EDGES, EDGE_FEATURES)).astype(np.float32),
        senders=rng.integers(0, NODES, EDGES).astype(np.int32),
        receivers=rng.integers(0, NODES, EDGES).astype(np.int32),
        globals=rng.normal(size=(1, 2)).astype(np.float32),
        n_node=np.array([NODES], np.int32), n_edge=np.array([EDGES], np.int32)) for _ in range(GRAPHS)]
    batched = {k: v.astype(np.int32) if v.dtype.kind == "i" else v for k, v in jraph.batch_np(graphs)._asdict().items()}
    batched["labels"] = rng.integers(0, C, GRAPHS * NODES).astype(np.int32)
    batched["targets"] = rng.normal(size=(GRAPHS,)).astype(np.float32)
    return batched


def _graph_spec():
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), _graphs(0))


def _gnn_model():
    import flax.linen as nn
    import jraph

    class GNN(nn.Module):
        """GCN -> GAT (2 heads) -> GraphNetwork (edge, node and global updates), linen MLPs."""

        @nn.compact
        def __call__(self, graph):
            graph = jraph.GraphConvolution(nn.Dense(H, name="gcn"), add_self_edges=True)(graph)
            graph = graph._replace(nodes=nn.relu(graph.nodes))

            def attention_logit(sent, received, edges):
                return nn.leaky_relu(nn.Dense(2, name="gat_logit")(jnp.concatenate([sent, received], -1)))

            heads = lambda n: nn.Dense(2 * H // 2, name="gat_query")(n).reshape(n.shape[0], 2, H // 2)
            graph = jraph.GAT(heads, lambda s, r, e: attention_logit(
                s.reshape(s.shape[0], -1), r.reshape(r.shape[0], -1), e)[..., None])(graph)

            def update_edge(edges, sent, received, globals_):
                x = jnp.concatenate([edges, sent, received, globals_], -1)
                return nn.Dense(H, name="edge_out")(nn.relu(nn.Dense(H, name="edge_hidden")(x)))

            def update_node(nodes, sent, received, globals_):
                x = jnp.concatenate([nodes, sent, received, globals_], -1)
                return nn.Dense(H, name="node_out")(nn.relu(nn.Dense(H, name="node_hidden")(x)))

            def update_global(nodes, edges, globals_):
                return nn.Dense(1, name="global_out")(jnp.concatenate([nodes, edges, globals_], -1))

            graph = jraph.GraphNetwork(update_edge, update_node, update_global,
                                       aggregate_edges_for_nodes_fn=jraph.segment_max_or_constant)(graph)
            return nn.Dense(C, name="classify")(graph.nodes), graph.globals[:, 0]

    return GNN()


def jraph_gnn():
    """The ``jraph_gnn`` probe (jraph GraphConvolution, GAT, GraphNetwork with linen MLPs over a
    jraph.batch of 4 graphs): ``fidelity.py --workload benchmarks/heldout_graph_rec.py:jraph_gnn``."""
    import jraph

    model = _gnn_model()
    fields = jraph.GraphsTuple._fields

    def graph_of(batch):
        return jraph.GraphsTuple(**{k: batch[k] for k in fields})

    def loss_fn(params, batch):
        logits, regression = model.apply({"params": params}, graph_of(batch))
        classify = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()
        return classify + jnp.mean((regression - batch["targets"]) ** 2)

    def abstract_params():
        example = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), _graph_spec())
        return jax.eval_shape(lambda: model.init(jax.random.key(0), graph_of(example)))["params"]

    return make_workload("jraph_gnn", None, loss_fn=loss_fn, abstract_params=abstract_params, fill_param=_fill,
                         abstract_batch=_graph_spec, make_batch=_graphs, learning_rate=1e-3)


# --- griffin ---------------------------------------------------------------------------------------


def griffin():
    """The ``griffin`` probe (recurrentgemma's Griffin: RG-LRU recurrence under lax.scan, local
    attention, 3 blocks of width 32): ``fidelity.py --workload benchmarks/heldout_graph_rec.py:griffin``."""
    from recurrentgemma import common
    from recurrentgemma.jax import griffin as rg

    block = common.TemporalBlockType
    config = common.GriffinConfig(
        vocab_size=V, width=32, mlp_expanded_width=64, num_heads=4,
        block_types=(block.RECURRENT, block.RECURRENT, block.ATTENTION), embeddings_scale_by_sqrt_dim=True,
        attention_window_size=8, logits_soft_cap=30.0, lru_width=32, scan_type=common.ScanType.LINEAR_NATIVE)
    model = rg.Griffin(config, gradient_checkpointing=False)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    params_shape = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((B, T), jnp.int32), positions))
    params_shape = params_shape["params"]

    def loss_fn(params, batch):
        logits, _ = model.apply({"params": params}, batch["tokens"], positions)
        return _next_token_loss(logits, batch["tokens"])

    return _lm_workload("griffin", params_shape, loss_fn)


# --- penzai_lm -------------------------------------------------------------------------------------


def penzai_lm():
    """The ``penzai_lm`` probe (penzai's llama-like transformer, named-axis pz layers, GQA, RoPE,
    SwiGLU; 2 blocks of width 32): ``fidelity.py --workload benchmarks/heldout_graph_rec.py:penzai_lm``."""
    from penzai import pz
    from penzai.models.transformer.variants import llamalike_common

    config = llamalike_common.LlamalikeTransformerConfig(
        num_kv_heads=2, query_head_multiplier=2, embedding_dim=32, projection_dim=8, mlp_hidden_dim=64,
        num_decoder_blocks=2, vocab_size=V, mlp_variant="swiglu", tie_embedder_and_logits=False)
    model = llamalike_common.build_llamalike_transformer(config, init_base_rng=jax.random.key(0))
    unbound, params = pz.unbind_params(model, freeze=True)
    labels = [p.label for p in params]
    params_shape = {p.label: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), p.value)
                    for p in params}

    def loss_fn(params_tree, batch):
        bound = pz.bind_variables(unbound, [pz.ParameterValue(label=k, value=params_tree[k]) for k in labels])
        tokens = pz.nx.wrap(batch["tokens"]).tag("batch", "seq")
        logits = bound(tokens).untag("batch", "seq", "vocabulary").unwrap()
        return _next_token_loss(logits, batch["tokens"])

    return _lm_workload("penzai_lm", params_shape, loss_fn)
