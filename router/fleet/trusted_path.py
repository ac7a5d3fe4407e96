"""Whether anyone but this user and root can change what a path names: the walk the checkpoint and
adapter checks run (``router.fleet.checkpoint.trusted_directory``) before the engines load a directory.

The engines load a refit's or an adapter's directory by its path, after the router checked the files,
and resolve the path again when they load. Whoever can rename an entry of any directory the path goes
through, or re-point a symlink on the way, chooses what they load: in issue 38 another user swapped
their own checkpoint into a team scratch they had made (``chmod 1777``) 0.05 ms after the check had
read the trainer's, and every engine verified and served it under the trainer's version. Checking the
``realpath``'s ancestors is not enough either: a symlink in such a scratch leads to a safe directory
at the check and elsewhere at the load. So the path is resolved here one name at a time, as the
kernel resolves it, and every directory read on the way and every symlink followed is judged.
"""

from __future__ import annotations

import functools
import grp
import os
import pwd
import stat


class UntrustedPath(ValueError):
    """A path another user could redirect; the message names where and says what to do."""


MAX_SYMLINKS = 40
"""Symlinks followed while a path is resolved (the kernel's own limit): a loop is refused, not walked."""


def _writers(st: os.stat_result) -> str:
    """Who besides its owner may add, rename and remove entries of a directory (``""`` when no one)."""
    if st.st_mode & stat.S_IWOTH:
        return "every user"
    if st.st_mode & stat.S_IWGRP:
        try:
            return f"group {grp.getgrgid(st.st_gid).gr_name} (gid {st.st_gid})"
        except KeyError:
            return f"group gid {st.st_gid}"
    return ""


def _user(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


@functools.cache
def _unmapped_owner() -> int | None:
    """The uid a file shows when its owner is one this process's user namespace does not map, or None
    outside such a namespace. In a container that maps only its user (enroot/pyxis: ``uid_map`` is
    ``UID UID 1``) the host's root, and every other host user, show as the overflow uid (65534)."""
    try:
        with open("/proc/self/uid_map") as f:
            if f.read().split() == ["0", "0", "4294967295"]:
                return None
        with open("/proc/sys/kernel/overflowuid") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def _unknown(uid: int) -> bool:
    """Whether ``uid`` is an owner this user namespace cannot name (the host's root, or another user)."""
    return uid == _unmapped_owner()


def _safe_to_look_up(directory: str, st: os.stat_result, what: str, private: bool) -> None:
    """Refuse ``directory`` (one the path is resolved through) unless only this user or root can change
    its entries: owned by one of them, and writable by nobody else, or sticky (then others may add
    names but not rename or remove this user's: ``/tmp``), or ``private``: below a directory of theirs
    that grants group and others no search, where no other user reaches it to write it. In a container
    that does not map the owner (``_unknown``), a directory no one else can write is taken for the host
    root's; a writable one is refused (``resolve_trusted``)."""
    me = os.geteuid()
    writers = _writers(st)
    if _unknown(st.st_uid) and (not writers or private):
        return  # in a container: most likely the host's root (/, /lustre), and writable by no one else
    if st.st_uid not in (me, 0):
        if _unknown(st.st_uid):
            raise UntrustedPath(
                f"{what} lies under {directory}, which {writers} can write (mode "
                f"{stat.S_IMODE(st.st_mode):04o}) and whose owner this container's user namespace does not "
                f"map (uid {st.st_uid}: the host's root, or another user): move it under a directory of "
                "yours"
            )
        raise UntrustedPath(
            f"{what} lies under {directory}, owned by {_user(st.st_uid)}: its owner can rename anything "
            f"in it (sticky or not) and put other files in its place between the check and the load; move "
            f"it under a directory only you (uid {me}) or root can change"
        )
    if writers and not st.st_mode & stat.S_ISVTX and not private:
        raise UntrustedPath(
            f"{what} lies under {directory}, which {writers} can write (mode {stat.S_IMODE(st.st_mode):04o}, "
            f"no sticky bit): any of them can rename it away and put another in its place; chmod go-w "
            f"{directory} (or chmod +t it), or move it"
        )


def resolve_trusted(path: str, what: str) -> str:
    """The real path of ``path``, resolved one name at a time the way the kernel resolves it, or
    ``UntrustedPath`` naming the first directory or symlink on the way that another user could
    change.

    Why every directory the resolution reads, not only the ancestors of the ``realpath``: the engines
    load the path later, resolving it again, and anyone who can rename an entry of any directory on the
    way (its owner, sticky bit or not; a group or everyone, without the sticky bit), or re-point a
    symlink the path goes through, chooses what they load, after this check read the right files
    (issue 38: a team scratch another user made, ``chmod 1777``, swapped under a checked checkpoint in
    0.05 ms). What passes here can be changed only by this user and root, so the path names, at the
    load, the directory that was checked unless this user itself moves it (what the adapter restore's
    digest, ``router.fleet.adapter_check.adapter_digest``, and the full restore's checksum are for).

    A directory group or others can write is fine below one of this user's (or root's) that grants
    group and others no search permission (``mode & 0o011 == 0``: a job directory is 0700): no other
    user can reach it to rename anything. Under umask 002 a trainer's ``mkdir -p`` makes every folder
    it adds 0775, and refusing those inside a private job directory would refuse what nobody can
    change. Another user's directory is refused wherever it is.

    In a container whose user namespace maps only this user (enroot/pyxis), the host's root shows as
    the overflow uid, as does every other host user: a directory of such an owner is taken for root's
    only when no one else can write it (``/``, ``/lustre``, a root-made project directory); a sticky or
    group-writable one (a team scratch, ``/tmp`` as the container sees it) is refused. What the router
    cannot tell there: a 0755 directory of another host user above this user's checkpoint."""
    me = os.geteuid()
    todo = [c for c in reversed(path.split("/")) if c]
    current, hops = "/", 0
    private = {current: False}  # whether an ancestor keeps every other user out (search denied)
    looked_up: dict[str, os.stat_result] = {}
    while todo:
        name = todo.pop()
        if name == ".":
            continue
        if name == "..":
            current = os.path.dirname(current)
            continue
        if current not in looked_up:
            looked_up[current] = os.stat(current)
            _safe_to_look_up(current, looked_up[current], what, private[current])
        entry = os.path.join(current, name)
        st = os.lstat(entry)
        if stat.S_ISLNK(st.st_mode):
            hops += 1
            if hops > MAX_SYMLINKS:
                raise UntrustedPath(
                    f"{what}: more than {MAX_SYMLINKS} symlinks on the way (a loop?); give the real path"
                )
            parent = looked_up[current]
            if st.st_uid not in (me, 0) and not (_unknown(st.st_uid) and not _writers(parent)):
                raise UntrustedPath(
                    f"{what}: the path goes through the symlink {entry}, owned by {_user(st.st_uid)}, "
                    "which its owner can point elsewhere; give the directory it leads to"
                )
            target = os.readlink(entry)
            todo.extend(c for c in reversed(target.split("/")) if c)
            if target.startswith("/"):
                current = "/"
            continue
        shields = looked_up[current].st_uid in (me, 0) and not looked_up[current].st_mode & 0o011
        private[entry] = private[current] or shields
        current = entry
    return current
