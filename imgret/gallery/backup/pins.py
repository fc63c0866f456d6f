"""Pins: hard links that keep the bytes of media files and checkpoints alive while a backup
copies them.

A delete removes image bytes (``imgret.gallery.media.gc``), so a file the snapshot refers to may
vanish while a backup runs. The backup links every file it may need into
``<data_dir>/.backup-pins/<pid>-<token>/`` (same file system as the store: a link copies
nothing and keeps the bytes after the store unlinks them); where a link is impossible (the
store on another file system than the data dir) the file is copied instead. When and under
which lock files are pinned: :mod:`imgret.gallery.backup.snapshot`.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from imgret.files import process_exists
from imgret.gallery.backup.layout import MEDIA_DIR, MODELS_DIR
from imgret.gallery.media.files import MediaStore

PINS_DIR = ".backup-pins"


class Pins:
    """Hard links that keep the bytes of media files and checkpoints alive during a backup."""

    def __init__(self, root: Path, media: MediaStore, data_dir: Path):
        self.root, self.media, self.data_dir = root, media, data_dir
        self.media_keys: set[str] = set()
        self.versions: set[str] = set()
        self.copied_under_lock = 0

    def media_path(self, sha: str) -> Path:
        return self.root / MEDIA_DIR / sha

    def checkpoint_path(self, version: str) -> Path:
        return self.root / MODELS_DIR / version / "model.pt"

    def link_all(self) -> None:
        (self.root / MEDIA_DIR).mkdir(parents=True, exist_ok=True)
        for sha in self.media.stored_keys():
            self.link_media(sha)
        models = self.data_dir / MODELS_DIR
        if models.is_dir():
            for path in models.glob("*/model.pt"):
                self.link_checkpoint(path.parent.name)

    def link_media(self, sha: str) -> bool:
        """Pin one stored file; False when the store no longer has it."""
        if sha not in self.media_keys and self._link(self.media.path(sha), self.media_path(sha)):
            self.media_keys.add(sha)
        return sha in self.media_keys

    def link_checkpoint(self, version: str) -> bool:
        source = self.data_dir / MODELS_DIR / version / "model.pt"
        self.checkpoint_path(version).parent.mkdir(parents=True, exist_ok=True)
        if version not in self.versions and self._link(source, self.checkpoint_path(version)):
            self.versions.add(version)
        return version in self.versions

    def _link(self, source: Path, target: Path) -> bool:
        try:
            os.link(source, target)
        except FileNotFoundError:
            return False
        except FileExistsError:
            return True
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                raise
            try:
                shutil.copyfile(source, target)  # no hard links here: a copy pins as well
            except FileNotFoundError:
                return False
            self.copied_under_lock += 1
        return True


def remove_dead_pins(root: Path) -> None:
    """Remove pin folders of backups whose process died (``<pid>-<token>``)."""
    if not root.is_dir():
        return
    for folder in root.iterdir():
        pid = folder.name.split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        if not process_exists(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
