-- fenced SQLite schema v2: the holder's label (`fenced_api::Label`), NULL
-- when the holder gave none. Shown by inspect/list, never compared, so TEXT.
-- A nullable column added at the end: statements of v1 builds name their
-- columns, so they keep working beside it (they store no label).
ALTER TABLE "{base}" ADD COLUMN label TEXT;
