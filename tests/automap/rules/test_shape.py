"""Shape ops: broadcast, reshape (split / merge / blocked runs), transpose, squeeze, expand_dims,
concatenate, pad, slice, rev, iota, split."""
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from harness import MESH_8, UNCHECKED, check, row

S = (16, 32)
DM = P("data", "model")

ROWS = [
    # name, fn, args, input specs, output spec, collective kinds
    # broadcast_in_dim
    row("broadcast_new_major", lambda x: jnp.broadcast_to(x, (16, 32)), [(32,)], {"x": P("model")},
        P(None, "model"), set()),
    row("broadcast_new_minor", lambda x: jnp.broadcast_to(x[:, None], (16, 32)), [(16,)], {"x": P("data")},
        P("data"), set()),
    row("broadcast_size1", lambda x: jnp.broadcast_to(x, (16, 32)), [(1, 32)], {"x": P(None, "model")},
        P(None, "model"), set()),
    # the new dim takes its axis from the other operand of the add (backward through broadcast)
    row("broadcast_then_add", lambda b, x: jnp.broadcast_to(b, x.shape) + x, [(32,), S],
        {"b": P("model"), "x": P("data")}, DM, set(), inner={"broadcast_in_dim": DM}),
    # jnp's rank promotion: (32,) -> (1, 32), then a rank-equal size-1 add
    row("broadcast_rank_promotion", lambda b, x: x + b, [(32,), S], {"b": P("model"), "x": P("data")}, DM, set(),
        inner={"broadcast_in_dim": P(None, "model")}),
    row("broadcast_scalar", lambda s, x: jnp.broadcast_to(s, x.shape) * x, [(), S], {"x": DM}, DM, set(),
        inner={"broadcast_in_dim": DM}),
    # reshape
    row("reshape_split_heads", lambda x: x.reshape(2, 8, 4, 8), [(2, 8, 32)], {"x": P("data", None, "model")},
        P("data", None, "model"), set()),
    row("reshape_split_heads_8", lambda x: x.reshape(2, 8, 8, 8), [(2, 8, 64)], {"x": P(None, None, "x")},
        P(None, None, "x"), set(), mesh=MESH_8),
    row("reshape_split_two_axes", lambda x: x.reshape(8, 2, 32), [S], {"x": P(("data", "model"))},
        P(("data", "model")), set()),
    row("reshape_split_axes_in_order", lambda x: x.reshape(4, 4, 32), [S], {"x": P(("model", "data"))},
        P("model", "data"), set()),
    # 16 rows over data x model (blocks of 2) -> (4, 4): 'model' would have to split between the
    # two dims; only 'data' survives on the major dim
    row("reshape_split_not_expressible", lambda x: x.reshape(4, 4, 32), [S], {"x": P(("data", "model"))},
        P("data"), {"all-gather"}),
    row("reshape_split_across", lambda x: x.reshape(2, 8, 32), [S], {"x": P(("data", "model"))},
        P("data", "model"), set()),
    row("reshape_merge_heads", lambda x: x.reshape(2, 8, 32), [(2, 8, 4, 8)], {"x": P("data", None, "model")},
        P("data", None, "model"), set()),
    row("reshape_merge_batch", lambda x: x.reshape(16, 32), [(2, 8, 32)], {"x": P("data", None, "model")},
        DM, set()),
    row("reshape_merge_both", lambda x: x.reshape(16, 32), [(2, 8, 32)], {"x": P("data", "model")},
        P(("data", "model")), set()),
    # a merge whose minor dim only is sharded is not a block tiling of the merged dim
    # (automap.propagate.reshards misses this gather: the factor's axes vanish from the result)
    row("reshape_merge_minor_sharded", lambda x: x.reshape(16, 32), [(2, 8, 32)], {"x": P(None, "model")},
        P(), {"all-gather"}, model=UNCHECKED),
    row("reshape_size1", lambda x: x.reshape(16, 1, 32), [S], {"x": DM}, P("data", None, "model"), set()),
    # (8, 12) -> (12, 8) both splits and merges: a common major factor 4, the rest stays whole
    row("reshape_common_major", lambda x: x.reshape(12, 8), [(8, 12)], {"x": P("model")}, P("model"), set()),
    row("reshape_blocked", lambda x: x.reshape(12, 8), [(8, 12)], {"x": P(None, "model")}, P(), {"all-gather"}),
    row("reshape_regroup", lambda x: x.reshape(24, 16), [(8, 48)], {"x": P(("data", "model"))},
        P(("data", "model")), set()),
    # 48 = (3, 16) in blocks of 12 does not tile (24, 16): 'model' is gathered
    row("reshape_regroup_lossy", lambda x: x.reshape(24, 16), [(8, 48)], {"x": P("data", "model")},
        P("data"), {"all-gather"}),
    row("reshape_regroup_minor", lambda x: x.reshape(8, 3, 16), [(24, 16)], {"x": P(None, "model")},
        P(None, None, "model"), set()),
    # transpose
    row("transpose_2d", lambda x: x.T, [S], {"x": DM}, P("model", "data"), set()),
    row("transpose_3d", lambda x: x.transpose(2, 0, 1), [(8, 16, 32)], {"x": P("data", None, "model")},
        P("model", "data"), set()),
    row("transpose_heads", lambda x: x.reshape(2, 8, 4, 8).transpose(0, 2, 1, 3), [(2, 8, 32)],
        {"x": P("data", None, "model")}, P("data", "model"), set()),
    # squeeze / expand_dims
    row("squeeze", lambda x: x[:, 0, :], [(16, 1, 32)], {"x": P("data", None, "model")}, DM, set()),
    row("squeeze_lax", lambda x: lax.squeeze(x, (0,)), [(1, 16, 32)], {"x": P(None, "data", "model")}, DM, set()),
    row("expand_dims", lambda x: jnp.expand_dims(x, 1), [S], {"x": DM}, P("data", None, "model"), set()),
    row("expand_dims_front", lambda x: x[None], [S], {"x": DM}, P(None, "data", "model"), set()),
    # concatenate
    row("concat_unsharded_dim", lambda x, y: jnp.concatenate([x, y], axis=1), [S, (16, 8)],
        {"x": P("data"), "y": P("data")}, P("data"), set()),
    row("concat_other_dim", lambda x, y: jnp.concatenate([x, y], axis=0), [S, (8, 32)],
        {"x": P(None, "model"), "y": P(None, "model")}, P(None, "model"), set()),
    # of rank one, XLA gathers the pieces
    row("concat_sharded_dim", lambda x, y: jnp.concatenate([x, y]), [(32,), (16,)], {"x": P("x"), "y": P("x")},
        P(), {"all-gather"}, mesh=MESH_8),
    # of higher rank the joined dim stays sharded (a permutation factor): an all-to-all of each
    # operand and of the result (2 x 512 + 1,024 B a device)
    row("concat_sharded_dim_kept", lambda x, y: jnp.concatenate([x, y], axis=1), [(16, 32), (16, 32)],
        {"x": P(None, "model"), "y": P(None, "model")}, P(None, "model"), {"all-to-all"}),
    # pieces of no common tiling: the dim stays whole (XLA moves the sharded piece by an all-to-all
    # into a batch-sharded layout and gathers the result; the estimate gathers the piece)
    row("concat_pieces_of_no_common_tiling", lambda x, y: jnp.concatenate([x, y], axis=1), [(16, 32), (16, 3)],
        {"x": P(None, "model")}, P(), {"all-gather", "all-to-all"}, model={"all-gather"}),
    # pad
    row("pad_unsharded_dim", lambda x: jnp.pad(x, ((0, 0), (1, 3))), [S], {"x": P("data")}, P("data"), set()),
    row("pad_sharded_dim", lambda x: jnp.pad(x, ((0, 0), (2, 2))), [S], {"x": DM}, P("data"), {"all-gather"}),
    row("pad_interior", lambda x: lax.pad(x, 0.0, ((0, 0, 0), (0, 0, 1))), [S], {"x": P("data")}, P("data"), set()),
    # slice
    row("slice_unsharded_dim", lambda x: x[:, 4:20], [S], {"x": P("data")}, P("data"), set()),
    # XLA slices a sharded dim with a halo exchange, then gathers the (replicated) result
    row("slice_sharded_dim", lambda x: x[4:20], [(32,)], {"x": P("x")}, P(), {"collective-permute", "all-gather"},
        mesh=MESH_8, model={"all-gather"}),
    row("slice_strided", lambda x: x[::2], [S], {"x": P(None, "model")}, P(None, "model"), set()),
    # rev
    row("rev_unsharded_dim", lambda x: jnp.flip(x, 1), [S], {"x": P("data")}, P("data"), set()),
    row("rev_sharded_dim", lambda x: jnp.flip(x, 1), [S], {"x": DM}, P("data"), {"all-gather"}),
    # iota: computed where it lives, its spec comes from its users
    row("iota_added", lambda x: x + jnp.arange(32, dtype=jnp.float32), [S], {"x": DM}, DM, set(),
        inner={"iota": P("model")}),
    row("iota_2d", lambda x: x + lax.broadcasted_iota(jnp.float32, (16, 32), 0), [S], {"x": DM}, DM, set(),
        inner={"iota": DM}),
    # split
    row("split_unsharded_dim", lambda x: tuple(jnp.split(x, 2, axis=1)), [S], {"x": P("data")},
        (P("data"), P("data")), set()),
    row("split_other_dim", lambda x: tuple(jnp.split(x, [4], axis=0)), [S], {"x": P(None, "model")},
        (P(None, "model"), P(None, "model")), set()),
    row("split_sharded_dim", lambda x: tuple(jnp.split(x, 2)), [(32,)], {"x": P("x")}, (P(), P()),
        {"all-gather", "collective-permute"}, mesh=MESH_8, model={"all-gather"}),
    # stack (jnp.stack, rotary embeddings): operands share every dim, the new dim stays whole
    row("stack_minor", lambda x, y: jnp.stack([x, y], axis=-1), [S, S], {"x": DM, "y": DM},
        P("data", "model", None), set(), inner={"stack": P("data", "model", None)}),
    row("stack_major", lambda x, y: jnp.stack([x, y]), [S, S], {"x": P("data")}, P(None, "data"), set()),
    row("stack_into_sharded_user", lambda x, y, z: jnp.stack([x, y], axis=1) * z, [(16,), (16,), (16, 2)],
        {"z": P("data")}, P("data"), set(), inner={"stack": P("data")}),
    # unstack: the unstacked dim disappears, the others are shared
    row("unstack", lambda x: tuple(lax.unstack(x, axis=1)), [(16, 2, 32)], {"x": P("data", None, "model")},
        (DM, DM), set()),
    # tile: an unrepeated dim is shared; a repeated one is (rep, n): the copies split, each whole
    row("tile_unrepeated_dim", lambda x: jnp.tile(x, (2, 1)), [S], {"x": P(None, "model")}, P(None, "model"),
        set()),
    row("tile_copies_split", lambda x, y: jnp.tile(x, (4, 1)) + y, [(16, 32), (64, 32)], {"y": P("model")},
        P("model"), set(), inner={"tile": P("model")}),
    row("tile_rows_and_copies", lambda x, y: jnp.tile(x, (4, 1)) + y, [(16, 32), (64, 32)],
        {"x": P("data"), "y": P(("model", "data"))}, P(("model", "data")), set(), inner={"tile": P(("model", "data"))}),
]


@pytest.mark.parametrize("r", ROWS)
def test_shape(r):
    check(r)
