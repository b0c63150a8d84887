"""Which ranks keep a copy of which rank's local-checkpoint part: the replication cliques.

:class:`CliqueReplicationStrategy` (the reference's name) cuts the ranks into disjoint
cliques; every rank's part is kept on the nodes of its clique mates. The daemons, not the
trainers, move the replicas; this module only decides who they go to.
"""

from __future__ import annotations

from ckpt_client.collectives import initialized, rank_and_world


class CliqueReplicationStrategy:
    """Replicate each rank's part to the other ranks of its clique.

    Parameters
    ----------
    cliques : list of list of int
        Disjoint groups of ranks covering ``range(world_size)``; each rank's part is kept
        by every rank (that is, that rank's node) of its clique.

    See Also
    --------
    from_replication_params : build the cliques from a jump and a factor.
    """

    def __init__(self, cliques: list[list[int]]) -> None:
        ranks = sorted(r for c in cliques for r in c)
        if ranks != list(range(len(ranks))):
            raise ValueError(f"cliques {cliques} must cover ranks 0..N-1 exactly once each")
        self.cliques = [list(c) for c in cliques]
        self.world_size = len(ranks)

    @classmethod
    def from_replication_params(cls, replication_jump: int = 1, replication_factor: int = 2,
                                world_size: int | None = None) -> "CliqueReplicationStrategy":
        """Cliques of ``replication_factor`` ranks spaced ``replication_jump`` apart.

        The ranks are cut into consecutive blocks of ``replication_jump *
        replication_factor``; inside a block, rank ``b + o`` (offset ``o <
        replication_jump``) forms a clique with ``b + o + k * replication_jump`` for
        ``k < replication_factor``. So jump 1 groups consecutive ranks (0,1), (2,3), ...;
        with 8 ranks, jump 4 and factor 2 gives (0,4), (1,5), (2,6), (3,7): set the jump
        to the number of ranks per node so that clique mates live on different nodes.

        The world size must be a multiple of ``replication_jump * replication_factor``;
        otherwise some cliques would be short (uneven), and the call is refused.

        Parameters
        ----------
        replication_jump : int
            Distance between the ranks of a clique (>= 1).
        replication_factor : int
            Ranks per clique, i.e. copies of each part (>= 1; 1 = no replication).
        world_size : int, optional
            Default: the size of the initialized default process group.

        Raises
        ------
        ValueError
            For a jump or factor below 1, or a world size that is not a multiple of
            ``replication_jump * replication_factor``.
        """
        if world_size is None:
            if initialized() is None:
                raise ValueError("from_replication_params needs world_size= or an initialized "
                                 "torch.distributed process group")
            _, world_size = rank_and_world()
        for name, value in (("replication_jump", replication_jump),
                            ("replication_factor", replication_factor)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, not {value!r}")
        block = replication_jump * replication_factor
        if world_size % block:
            raise ValueError(
                f"cannot form even cliques: world size {world_size} is not a multiple of "
                f"replication_jump x replication_factor = {replication_jump} x "
                f"{replication_factor} = {block}; choose a jump and factor whose product "
                f"divides {world_size} (e.g. jump = ranks per node, factor 2)")
        cliques = [[start + offset + k * replication_jump for k in range(replication_factor)]
                   for start in range(0, world_size, block) for offset in range(replication_jump)]
        return cls(cliques)

    def clique_of(self, rank: int) -> list[int]:
        """The clique ``rank`` belongs to."""
        return next(c for c in self.cliques if rank in c)

    @property
    def replication_factor(self) -> int:
        """Copies of each part (clique size)."""
        return len(self.cliques[0]) if self.cliques else 1
