"""`LoadStatus`: the restored roots, TF's status assertions and deferred restoration."""

from __future__ import annotations

from typing import Any

from checkpoint._graph import RestoreState, restore_roots


class LoadStatus:
    """The result of `Checkpoint.restore`: restored roots, TF's assertions, deferred restoration.

    ``status.<root>`` is the restored pytree for that root (the template's
    structure and resource ids, values from the checkpoint).
    ``status.restore(**more_roots)`` restores roots created later from the
    same checkpoint (e.g. an optimizer state made after the model was
    restored) and returns a status holding them and every root restored
    before; the assertions of every status of one restore see them all.
    An optimizer state takes its slots only from Variables restored before
    it or with it: the state a restore returned cannot change, so restoring
    its Variables afterwards raises ValueError. A `restore` that raises
    leaves the account as it was.

    Args:
        state: the restore's shared account (what the checkpoint holds and what
            restores took); `Checkpoint.restore` makes it.
        roots: the restored roots by name.

    Raises:
        AttributeError: ``status.<name>`` of a root not restored (naming those
            that are).

    >>> import os, tempfile, jax.numpy as jnp, varstate, checkpoint
    >>> w = varstate.Variable(jnp.ones(3), name="w")
    >>> path = checkpoint.Checkpoint(model={"w": w}, step=jnp.int32(7)).write(os.path.join(tempfile.mkdtemp(), "c"))
    >>> status = checkpoint.Checkpoint(model={"w": varstate.Variable(jnp.zeros(3))}).restore(path)
    >>> status.assert_existing_objects_matched().model["w"].value.tolist()
    [1.0, 1.0, 1.0]
    >>> later = status.restore(step=jnp.int32(0))
    >>> int(later.step), sorted(later.roots)
    (7, ['model', 'step'])
    >>> status.assert_consumed() is status
    True
    """

    def __init__(self, state: RestoreState, roots: dict[str, Any], _every: dict[str, Any] | None = None) -> None:
        self._state = state
        self._roots = roots
        # Every root restored so far by any status of this restore, shared among them, so the status
        # `restore` returns holds the earlier roots too (a later root of the same name replaces one).
        self._every = _every if _every is not None else dict(roots)

    def __getattr__(self, name: str) -> Any:
        roots = self.__dict__.get("_roots", {})
        if name in roots:
            return roots[name]
        raise AttributeError(f"LoadStatus has no restored root {name!r}; it has {sorted(roots)}.")

    def __repr__(self) -> str:
        st = self._state
        return f"LoadStatus(roots={sorted(self._roots)}, matched={len(st.matched)}, unmatched={len(st.unmatched)})"

    @property
    def roots(self) -> dict[str, Any]:
        """The restored roots by name."""
        return dict(self._roots)

    # --- restoring ------------------------------------------------------------
    def restore(self, **roots: Any) -> LoadStatus:
        """Restores more roots from the values still pending (deferred restoration).

        The status returned holds these roots and every root restored before
        them from the same checkpoint.

        Args:
            **roots: templates of the roots to restore, by name.

        Returns:
            A new LoadStatus holding these roots and the earlier ones.

        Raises:
            ValueError: as `Checkpoint.restore`; and Variables whose slots
                an optimizer state restored earlier has left unrestored
                (restore the Variables first, or give the optimizer state
                again beside them). Nothing is restored then, and this
                status's account is unchanged.
        """
        self._every.update(restore_roots(self._state, roots))
        return LoadStatus(self._state, dict(self._every), self._every)

    # --- TF's assertions --------------------------------------------------------
    def assert_consumed(self) -> LoadStatus:
        """Checks that every checkpointed value was restored and every object matched (TF's semantics).

        Returns:
            This status, to chain (``status.assert_consumed().model``).

        Raises:
            AssertionError: an object was unmatched, a checkpointed value or slot was
                not restored (the message names the first).
        """
        self.assert_existing_objects_matched()
        st = self._state
        if st.pending_slots:  # checked first: more specific than the unresolved slot nodes
            pending = st.pending_descriptions()
            raise AssertionError(
                f"Unresolved slot restorations: {len(pending)} slots were not restored, showing "
                f"{min(len(pending), 10)}: {'; '.join(pending[:10])}. Give each slot's Variable to a restore, "
                "before or with its optimizer state, and make that state from the restored Variables "
                "(opt.init(status.model)); or call expect_partial() and use assert_existing_objects_matched()."
            )
        unresolved = st.unresolved()
        if unresolved:
            first = unresolved[0]
            keys = ", ".join(a.checkpoint_key for a in st.proto.nodes[first].attributes)
            raise AssertionError(
                f"Unresolved object in checkpoint {st.names[first]}: its value ({keys}) was not restored into any "
                "object. Pass the object that should receive it (status.restore(...)) or call expect_partial() "
                "and use assert_existing_objects_matched()."
            )
        return self

    def assert_existing_objects_matched(self) -> LoadStatus:
        """Checks that every object given to a restore (with a value) was matched in the checkpoint.

        Returns:
            This status, to chain (``status.assert_consumed().model``).

        Raises:
            AssertionError: an object was unmatched (the message lists up to
                10, and names each root that matched no value of the checkpoint
                with the checkpoint's roots).
        """
        unmatched = list(self._state.unmatched)
        if unmatched:
            n = len(unmatched)
            raise AssertionError(
                f"Found {n} Python objects that were not bound to checkpointed values, likely due to "
                f"changes in the Python program. Showing {min(n, 10)} of {n} unmatched objects: {unmatched[:10]}"
                + _why(self._state)
            )
        return self

    def assert_nontrivial_match(self) -> LoadStatus:
        """Checks that something other than the root matched (the checkpoint fits the program at all).

        Returns:
            This status, to chain (``status.assert_consumed().model``).

        Raises:
            AssertionError: nothing but the root matched.
        """
        st = self._state
        matched = [label for label in st.matched.values() if label not in ("(root)", "(root).save_counter")]
        if not matched:
            if st.unmatched:
                raise AssertionError(
                    "Nothing except the root object matched a checkpointed value. Typically this means that "
                    "the checkpoint does not match the Python program. The following objects have no matching "
                    f"checkpointed value: {list(st.unmatched)[:10]}"
                    + _why(st)
                )
            raise AssertionError("Nothing to load. No dependencies have been added to the Checkpoint yet.")
        return self

    def expect_partial(self) -> LoadStatus:
        """Silences the warning about unrestored values logged when the restore is discarded.

        Returns:
            This status.
        """
        self._state.expect_partial = True
        return self


def _why(state: RestoreState) -> str:
    """The end of an assertion's message: why each root that matched nothing did not (see `restore_roots`)."""
    return ". " + " ".join(state.dead_roots.values()) if state.dead_roots else ""


class InitializationOnlyStatus(LoadStatus):
    """`restore(None)`: nothing to restore from; the roots are returned as given and every assertion fails."""

    def __init__(self, roots: dict[str, Any], _every: dict[str, Any] | None = None) -> None:
        self._roots = roots
        self._every = _every if _every is not None else dict(roots)

    def restore(self, **roots: Any) -> LoadStatus:
        self._every.update(roots)
        return InitializationOnlyStatus(dict(self._every), self._every)

    def assert_consumed(self) -> LoadStatus:
        raise AssertionError(
            "No checkpoint specified (save_path=None); nothing is being restored. The roots are returned as given."
        )

    assert_existing_objects_matched = assert_nontrivial_match = assert_consumed

    def expect_partial(self) -> LoadStatus:
        return self
