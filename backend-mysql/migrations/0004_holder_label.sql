-- fenced schema v4: the holder's label (`fenced_api::Label`: at most 128
-- bytes of UTF-8), NULL when the holder gave none. VARBINARY like the owner,
-- so the table's character set never alters a byte. Shown by inspect and
-- list, never compared. `{base}` is replaced by the validated base table name.
--
-- One column per grant record: the unique_key row, the optimistic row, and
-- row_lock's grant description in `{base}_live` (`ALTER` of a MEMORY table
-- copies its rows, the lifetime row included, and keeps its AUTO_INCREMENT
-- counter, so no token can repeat). Each `ALTER` waits for the metadata
-- locks of open transactions on its table — a `row_lock` hold keeps one on
-- `{base}_live` until it ends — and lock traffic on that table waits behind
-- it: migrate when holds are short or few. Runs unchanged on MySQL 8.0+ and
-- MariaDB 10.3+ (neither `ADD COLUMN IF NOT EXISTS`, which MySQL lacks, nor
-- any other dialect). `migrate` skips an `ADD COLUMN` whose column is there
-- already, so a migrate that died halfway through these is finished by the next.
ALTER TABLE `{base}` ADD COLUMN label VARBINARY(128) NULL;
ALTER TABLE `{base}_optimistic` ADD COLUMN label VARBINARY(128) NULL;
ALTER TABLE `{base}_live` ADD COLUMN label VARBINARY(128) NULL
