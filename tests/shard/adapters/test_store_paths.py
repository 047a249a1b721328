"""Resolving prefix/adapter ids inside their store: every way out is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from tgis.shard.adapters.store_paths import ItemStore, StoreError, StoreErrorKind

CHARS = "must contain only alphanumeric, _ and - and /"


@pytest.fixture
def store(tmp_path: Path) -> ItemStore:
    root = tmp_path / "store"
    (root / "plain").mkdir(parents=True)
    (root / "nested" / "path").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "decoder.pt").write_bytes(b"x")
    return ItemStore(root)


def _refused(store: ItemStore, item_id: str) -> str:
    with pytest.raises(StoreError) as info:
        store.resolve(item_id)
    assert info.value.kind is StoreErrorKind.INVALID
    return str(info.value)


def test_plain_and_nested_ids_resolve_inside(store: ItemStore) -> None:
    root = store.root.resolve()
    assert store.resolve("plain") == root / "plain"
    assert store.resolve("nested/path") == root / "nested" / "path"
    assert store.resolve("does-not_exist") == root / "does-not_exist"  # existence is not checked


@pytest.mark.parametrize(
    "item_id", ["../outside", "a/../../x", "..", "x y", "a.b", "", "é$", "a\\b"]
)
def test_other_characters_are_refused_with_tgis_message(store: ItemStore, item_id: str) -> None:
    assert _refused(store, item_id) == f"Invalid prefix id {item_id}, {CHARS}"


@pytest.mark.parametrize("item_id", ["/etc", "/", "//tmp/x"])
def test_absolute_ids_are_refused(store: ItemStore, item_id: str) -> None:
    assert _refused(store, item_id) == f"Invalid prefix id {item_id}"


def test_symlink_out_of_the_store_is_refused(store: ItemStore) -> None:
    (store.root / "escape").symlink_to(store.root.parent / "outside")
    assert _refused(store, "escape") == "Invalid prefix id escape"


def test_dangling_symlink_out_and_symlink_loop_are_refused(store: ItemStore) -> None:
    (store.root / "dangling").symlink_to("/nonexistent-target")
    (store.root / "loop").symlink_to(store.root / "loop")
    assert _refused(store, "dangling") == "Invalid prefix id dangling"
    assert _refused(store, "loop") == "Invalid prefix id loop"


def test_symlink_to_the_store_root_is_refused(store: ItemStore) -> None:
    (store.root / "self").symlink_to(store.root)
    assert _refused(store, "self") == "Invalid prefix id self"


def test_symlink_inside_the_store_is_allowed(store: ItemStore) -> None:
    (store.root / "alias").symlink_to(store.root / "nested" / "path")
    assert store.resolve("alias") == store.root.resolve() / "nested" / "path"


def test_store_root_behind_a_symlink_works(tmp_path: Path, store: ItemStore) -> None:
    link = tmp_path / "store-link"
    link.symlink_to(store.root)
    assert ItemStore(link).resolve("plain") == store.root.resolve() / "plain"


def test_file_symlinked_out_of_the_store_is_refused(store: ItemStore) -> None:
    item = store.resolve("plain")
    (item / "decoder.pt").symlink_to(store.root.parent / "outside" / "decoder.pt")
    with pytest.raises(StoreError, match=r"^Invalid prefix id plain$"):
        store.file(item, "decoder.pt", "plain")


def test_file_lookup(store: ItemStore) -> None:
    item = store.resolve("nested/path")
    assert store.file(item, "decoder.pt", "nested/path") is None
    (item / "decoder.pt").write_bytes(b"x")
    assert store.file(item, "decoder.pt", "nested/path") == item / "decoder.pt"
    (item / "encoder.pt").mkdir()
    assert store.file(item, "encoder.pt", "nested/path") is None  # not a regular file


def test_noun_names_the_store_in_messages(store: ItemStore) -> None:
    adapters = ItemStore(store.root, "adapter")
    with pytest.raises(StoreError, match=r"^Invalid adapter id a\.b, must"):
        adapters.resolve("a.b")


def test_tgis_message_decoration() -> None:
    missing = StoreError(StoreErrorKind.NOT_FOUND, 'prefix id "x" not found')
    assert missing.tgis_message == 'prefix id "x" not found'
    bad = StoreError(StoreErrorKind.INVALID, "Invalid prefix embedding tensor")
    assert bad.tgis_message == "Unexpected <class 'Exception'>: Invalid prefix embedding tensor"
    big = StoreError(StoreErrorKind.INVALID, "too big", "ValueError")
    assert big.tgis_message == "Unexpected <class 'ValueError'>: too big"
