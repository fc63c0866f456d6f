"""What backup and restore refuse: one exception family, each message saying what to do."""

from __future__ import annotations

from imgret.errors import ImgretError


class BackupError(ImgretError):
    """A backup that cannot be made, or a backup (or target) that restore refuses."""


class BackupExists(BackupError):
    """The backup destination exists already."""


class BackupNoSpace(BackupError):
    """The backup's file system has too little free space for the estimated backup."""
