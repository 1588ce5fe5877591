//! Messages: ordered ids, values, and `MessageBatch`, the row-major arena that carries an epoch's
//! messages of one stream without a heap allocation per message.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::capacity::{reserve_projected, CapacityDecay, FaultedIn, Headroom, PROJECT_AFTER};
use crate::error::ValueError;
use crate::types::{Column, StreamSchema, StreamType};

/// Identifies a message: its partition and its offset in that partition. Ids of one partition are
/// ordered by offset; the printed form is `<partition>-<offset>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct MessageId {
    /// The source partition.
    pub partition: u32,
    /// The message's position within its partition, as the source numbers it.
    pub offset: u64,
}

impl MessageId {
    /// The id of message `offset` of `partition`.
    pub const fn new(partition: u32, offset: u64) -> Self {
        MessageId { partition, offset }
    }
}

impl fmt::Display for MessageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.partition, self.offset)
    }
}

impl FromStr for MessageId {
    type Err = ValueError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let bad = || ValueError::BadMessageId {
            text: text.to_owned(),
        };
        let (partition, offset) = text.split_once('-').ok_or_else(bad)?;
        Ok(MessageId {
            partition: partition.parse().map_err(|_| bad())?,
            offset: offset.parse().map_err(|_| bad())?,
        })
    }
}

/// A borrowed view of one value. Integers keep their sign class; dates are days and datetimes are
/// seconds, both carried as `Uint`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Value<'a> {
    /// No value (an `optional<T>` column's null).
    Null,
    /// A signed integer (`int8`..`int64`, `date32`, `timestamp`).
    Int(i64),
    /// An unsigned integer (`uint8`..`uint64`, `date`, `datetime`, `ipv4`).
    Uint(u64),
    /// A `float` or `double`.
    Float(f64),
    /// A `boolean`.
    Bool(bool),
    /// The bytes of a `string` or `utf8`.
    Bytes(&'a [u8]),
    /// A value of a type too wide or nested for the other variants (`decimal`, `uuid`,
    /// `list<T>`, ...), in its packed form: see [`crate::packed`](crate::PackedReader).
    Packed(&'a [u8]),
}

impl Value<'_> {
    /// What kind of value this is, as error messages name it (`a signed integer`, `null`).
    pub fn kind(&self) -> &'static str {
        match self {
            Value::Null => "null",
            Value::Int(_) => "a signed integer",
            Value::Uint(_) => "an unsigned integer",
            Value::Float(_) => "a floating-point number",
            Value::Bool(_) => "a boolean",
            Value::Bytes(_) => "a string",
            Value::Packed(_) => "a packed value",
        }
    }
}

/// The stored form of a value; strings live in the batch arena.
///
/// A full-word tag: with the default one-byte tag, building a cell stores one byte and copying it
/// then loads the whole word, a store-forwarding stall that cost about half of `RowWriter::push`
/// (seen with perf annotate). String positions are 32-bit so that a cell is 16 bytes, not 24: an
/// epoch of 100k rows of 6 columns holds 4.8 MB less (an epoch's strings are limited to 4 GiB).
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(u64)]
enum Cell {
    Null,
    Int(i64),
    Uint(u64),
    Float(f64),
    Bool(bool),
    Bytes { start: u32, len: u32 },
    Packed { start: u32, len: u32 },
}

const _: () = assert!(std::mem::size_of::<Cell>() == 16);

/// The messages of one stream in one epoch, stored row-major: a flat cell vector and one byte arena.
/// Clearing keeps the capacity, sized for an epoch at the batch's bound ([`Headroom`]), so a
/// partition reuses its batches across epochs, until a run of small epochs lets it go
/// ([`CapacityDecay`]).
#[derive(Clone, Debug)]
pub struct MessageBatch {
    schema: Arc<StreamSchema>,
    /// Each column's common accepted values, told without walking its type ([`FastRule`]).
    rules: Box<[FastRule]>,
    ids: Vec<MessageId>,
    cells: Vec<Cell>,
    arena: Vec<u8>,
    /// The most messages an epoch puts in the batch (`epoch.max_messages`), if known.
    bound: Option<usize>,
    decay: CapacityDecay,
    /// Ids, cells and arena: trimmed to their use and written once when their capacity changes
    /// ([`FaultedIn`]).
    faulted: [FaultedIn; 3],
}

/// Where a batch ended at some point ([`MessageBatch::mark`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BatchMark {
    rows: usize,
    cells: usize,
    arena: usize,
}

impl MessageBatch {
    /// An empty batch of stream `schema`.
    pub fn new(schema: Arc<StreamSchema>) -> Self {
        MessageBatch {
            rules: schema
                .columns()
                .iter()
                .map(|c| FastRule::of(&c.ty))
                .collect(),
            schema,
            ids: Vec::new(),
            cells: Vec::new(),
            arena: Vec::new(),
            bound: None,
            decay: CapacityDecay::default(),
            faulted: [FaultedIn::default(); 3],
        }
    }

    /// The batch, holding at most `messages` messages per epoch: its buffers keep room for that
    /// many ([`Headroom`]).
    pub(crate) fn bounded(mut self, messages: usize) -> Self {
        self.set_bound(messages);
        self
    }

    /// Bounds the batch to `messages` messages per use from now on ([`MessageBatch::bounded`]).
    pub(crate) fn set_bound(&mut self, messages: usize) {
        self.bound = Some(messages);
    }

    /// The most messages an epoch puts in the batch, if known.
    pub fn bound(&self) -> Option<usize> {
        self.bound
    }

    /// The stream's schema.
    pub fn schema(&self) -> &Arc<StreamSchema> {
        &self.schema
    }

    /// How many messages the batch holds.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Whether the batch holds no message.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Removes every message, keeping the capacity (sized for an epoch at the bound) unless a
    /// run of small epochs says it is no longer needed.
    pub fn clear(&mut self) {
        let headroom = Headroom::for_load(self.len(), self.bound);
        let needed = self.held_bytes(
            |v| headroom.target(v.len()),
            |v| headroom.target(v.len()),
            |v| headroom.target(v.len()),
        );
        let capacity = self.held_bytes(|v| v.capacity(), |v| v.capacity(), |v| v.capacity());
        if self.decay.should_shrink(needed, capacity) {
            headroom.fit(&mut self.ids);
            headroom.fit(&mut self.cells);
            headroom.fit(&mut self.arena);
        }
        let [ids, cells, arena] = &mut self.faulted;
        ids.settle(&mut self.ids, MessageId::new(0, 0), headroom);
        cells.settle(&mut self.cells, Cell::Null, headroom);
        arena.settle(&mut self.arena, 0, headroom);
    }

    fn held_bytes(
        &self,
        ids: impl Fn(&Vec<MessageId>) -> usize,
        cells: impl Fn(&Vec<Cell>) -> usize,
        arena: impl Fn(&Vec<u8>) -> usize,
    ) -> usize {
        ids(&self.ids) * std::mem::size_of::<MessageId>()
            + cells(&self.cells) * std::mem::size_of::<Cell>()
            + arena(&self.arena)
    }

    /// Where the batch ends now, to go back to with [`MessageBatch::truncate_to`].
    pub(crate) fn mark(&self) -> BatchMark {
        BatchMark {
            rows: self.ids.len(),
            cells: self.cells.len(),
            arena: self.arena.len(),
        }
    }

    /// Drops every row appended since `mark` was taken (a read that was cut off).
    pub(crate) fn truncate_to(&mut self, mark: BatchMark) {
        self.ids.truncate(mark.rows);
        self.cells.truncate(mark.cells);
        self.arena.truncate(mark.arena);
    }

    /// The ids of the messages, in batch order.
    pub fn ids(&self) -> &[MessageId] {
        &self.ids
    }

    /// Bytes held by string values, a cheap estimate of the batch's weight.
    pub fn arena_bytes(&self) -> usize {
        self.arena.len()
    }

    /// Message `index` (batch order); reading its values panics when `index` is out of range.
    pub fn row(&self, index: usize) -> Row<'_> {
        Row { batch: self, index }
    }

    /// Every message, in batch order.
    pub fn rows(&self) -> impl ExactSizeIterator<Item = Row<'_>> + '_ {
        (0..self.ids.len()).map(move |index| Row { batch: self, index })
    }

    /// Starts a new message. Values are pushed in schema order and checked against the column
    /// types; the row is kept only if `finish` is called, so a rejected value leaves the batch as it
    /// was before the row started.
    pub fn start_row(&mut self, id: MessageId) -> RowWriter<'_> {
        if self.ids.len() == self.ids.capacity() {
            self.grow_for_bound();
        }
        let cells_mark = self.cells.len();
        let arena_mark = self.arena.len();
        RowWriter {
            batch: self,
            id,
            cells_mark,
            arena_mark,
            finished: false,
        }
    }

    /// Makes room before the ids fill up: a bounded batch takes the room of an epoch at its
    /// bound once its first [`PROJECT_AFTER`] messages show their bytes per message
    /// ([`reserve_projected`]); ids and cells get exactly what clearing a full batch keeps (its
    /// [`Headroom`]), so that clearing does not reallocate them.
    #[cold]
    fn grow_for_bound(&mut self) {
        let len = self.ids.len();
        let Some(bound) = self.bound.filter(|&bound| bound > len) else {
            self.ids.reserve(1);
            return;
        };
        let messages = if len < PROJECT_AFTER {
            PROJECT_AFTER.min(bound)
        } else {
            reserve_projected(&mut self.arena, len, bound, usize::MAX);
            Headroom::NONE.target(bound)
        };
        if self.ids.try_reserve_exact(messages - len).is_err() {
            self.ids.reserve(1);
        }
        let cells = messages.saturating_mul(self.schema.len());
        let _ = self
            .cells
            .try_reserve_exact(cells.saturating_sub(self.cells.len()));
    }

    /// Copies one row of another batch with the same schema.
    pub fn push_row_from(&mut self, row: Row<'_>) -> Result<(), ValueError> {
        let mut writer = self.start_row(row.id());
        for column in 0..row.len() {
            writer.push(row.get(column))?;
        }
        writer.finish()
    }

    #[inline]
    fn value(&self, cell: Cell) -> Value<'_> {
        match cell {
            Cell::Null => Value::Null,
            Cell::Int(v) => Value::Int(v),
            Cell::Uint(v) => Value::Uint(v),
            Cell::Float(v) => Value::Float(v),
            Cell::Bool(v) => Value::Bool(v),
            Cell::Bytes { start, len } => {
                let start = start as usize;
                Value::Bytes(&self.arena[start..start + len as usize])
            }
            Cell::Packed { start, len } => {
                let start = start as usize;
                Value::Packed(&self.arena[start..start + len as usize])
            }
        }
    }
}

/// A borrowed row of a batch.
#[derive(Clone, Copy)]
pub struct Row<'a> {
    batch: &'a MessageBatch,
    index: usize,
}

impl<'a> Row<'a> {
    /// The message's id.
    pub fn id(&self) -> MessageId {
        self.batch.ids[self.index]
    }

    /// How many values the row has (its schema's column count).
    #[inline]
    pub fn len(&self) -> usize {
        self.batch.schema.len()
    }

    /// Whether the schema has no columns.
    pub fn is_empty(&self) -> bool {
        self.batch.schema.is_empty()
    }

    /// The stream type of column `column` (schema order); panics outside the schema, like `get`.
    pub fn column_type(&self, column: usize) -> &'a StreamType {
        &self.batch.schema.columns()[column].ty
    }

    /// The value of column `column` (schema order). Panics on an index outside the schema, which
    /// is a programming error, never an input error.
    // Inlined: the encoders in flow-clickhouse call it once per cell, and as a call across the
    // crate boundary it took a fifth of their time (flow-clickhouse/benches/encode.rs, generator
    // table: medians of 5, 28 M rows/s without, 34 M with).
    #[inline]
    pub fn get(&self, column: usize) -> Value<'a> {
        let width = self.batch.schema.len();
        self.batch
            .value(self.batch.cells[self.index * width + column])
    }

    /// Every value, in schema order.
    pub fn values(&self) -> impl Iterator<Item = Value<'a>> + 'a {
        let row = *self;
        (0..row.len()).map(move |column| row.get(column))
    }
}

/// Appends one row; see [`MessageBatch::start_row`].
pub struct RowWriter<'a> {
    batch: &'a mut MessageBatch,
    id: MessageId,
    cells_mark: usize,
    arena_mark: usize,
    finished: bool,
}

impl RowWriter<'_> {
    /// The column the next `push` fills, if the row is not full.
    pub fn next_column(&self) -> Option<&Column> {
        self.batch
            .schema
            .columns()
            .get(self.batch.cells.len() - self.cells_mark)
    }

    /// Checks `value` against the type of the next column and appends it.
    #[inline]
    pub fn push(&mut self, value: Value<'_>) -> Result<&mut Self, ValueError> {
        let column_index = self.batch.cells.len() - self.cells_mark;
        // Borrow the schema only for the check: no reference-count traffic per value.
        let fast = match self.batch.rules.get(column_index) {
            Some(rule) => rule.accept(value),
            None => None,
        };
        let cell = match fast {
            Some(cell) => cell,
            None => self.checked_cell(column_index, value)?,
        };
        let cell = match (cell, value) {
            (Cell::Bytes { .. }, Value::Bytes(bytes))
            | (Cell::Packed { .. }, Value::Packed(bytes)) => {
                let start = self.batch.arena.len();
                let (Ok(start32), Ok(len)) = (
                    u32::try_from(start),
                    u32::try_from(start + bytes.len()).map(|_| bytes.len() as u32),
                ) else {
                    return Err(self.arena_full(column_index));
                };
                self.batch.arena.extend_from_slice(bytes);
                if matches!(cell, Cell::Packed { .. }) {
                    Cell::Packed {
                        start: start32,
                        len,
                    }
                } else {
                    Cell::Bytes {
                        start: start32,
                        len,
                    }
                }
            }
            (cell, _) => cell,
        };
        self.batch.cells.push(cell);
        Ok(self)
    }

    /// Appends a byte-string value that `fill` writes straight into the batch (by appending to
    /// the vector it is given), checked against the next column's type as [`push`](Self::push)
    /// checks `Value::Bytes`: a source that makes its bytes (the generator's payload) saves
    /// copying them from a scratch buffer, a copy per row that the encoder's own copy follows.
    #[inline]
    pub fn push_bytes_with(
        &mut self,
        fill: impl FnOnce(&mut Vec<u8>),
    ) -> Result<&mut Self, ValueError> {
        let column_index = self.batch.cells.len() - self.cells_mark;
        let start = self.batch.arena.len();
        fill(&mut self.batch.arena);
        let value = Value::Bytes(&self.batch.arena[start..]);
        let fast = match self.batch.rules.get(column_index) {
            Some(rule) => rule.accept(value),
            None => None,
        };
        let checked = match fast {
            Some(cell) => Ok(cell),
            None => self.checked_cell(column_index, value),
        };
        // `check_value` stores a byte string as bytes or refuses it: the cell is always `Bytes`.
        let stored = checked.and_then(|_| {
            match (u32::try_from(start), u32::try_from(self.batch.arena.len())) {
                (Ok(start32), Ok(end32)) => Ok(Cell::Bytes {
                    start: start32,
                    len: end32 - start32,
                }),
                _ => Err(self.arena_full(column_index)),
            }
        });
        match stored {
            Ok(cell) => self.batch.cells.push(cell),
            Err(err) => {
                self.batch.arena.truncate(start);
                return Err(err);
            }
        }
        Ok(self)
    }

    /// The cell of `value` in column `column_index` by the full check of the column's type, for
    /// what [`FastRule`] does not take: every refusal is worded here.
    fn checked_cell(&self, column_index: usize, value: Value<'_>) -> Result<Cell, ValueError> {
        // Borrow the schema only for the check: no reference-count traffic per value.
        let schema = &*self.batch.schema;
        let column = schema
            .columns()
            .get(column_index)
            .ok_or(ValueError::TooManyValues {
                expected: schema.len(),
            })?;
        check_value(&column.ty, value).map_err(|what| ValueError::Invalid {
            column: column.name.clone(),
            ty: column.ty.clone(),
            what,
        })
    }

    /// The bytes this row holds in its batch so far: 16 per value pushed, plus the bytes of its
    /// strings and packed values (what a source that bounds its buffer by bytes counts).
    pub fn written_bytes(&self) -> usize {
        (self.batch.cells.len() - self.cells_mark) * std::mem::size_of::<Cell>()
            + (self.batch.arena.len() - self.arena_mark)
    }

    fn arena_full(&self, column_index: usize) -> ValueError {
        let column = &self.batch.schema.columns()[column_index];
        ValueError::Invalid {
            column: column.name.clone(),
            ty: column.ty.clone(),
            what: "the epoch's string data would exceed 4 GiB; lower epoch.max_messages".to_owned(),
        }
    }

    /// Keeps the row; every column must have a value.
    pub fn finish(mut self) -> Result<(), ValueError> {
        let pushed = self.batch.cells.len() - self.cells_mark;
        let expected = self.batch.schema.len();
        if pushed != expected {
            return Err(ValueError::MissingValues {
                expected,
                got: pushed,
            });
        }
        self.batch.ids.push(self.id);
        self.finished = true;
        Ok(())
    }
}

impl Drop for RowWriter<'_> {
    fn drop(&mut self) {
        if !self.finished {
            self.batch.cells.truncate(self.cells_mark);
            self.batch.arena.truncate(self.arena_mark);
        }
    }
}

/// Validates a value for a column type and returns the cell to store (strings as a placeholder
/// `Bytes` cell; the writer copies them into the arena). The error says what is wrong.
/// The largest value of an unsigned stream type (`date` and `datetime` included).
fn unsigned_max(ty: &StreamType) -> Option<u64> {
    Some(match ty {
        StreamType::Uint8 => u8::MAX.into(),
        StreamType::Uint16 | StreamType::Date => u16::MAX.into(),
        StreamType::Uint32 | StreamType::Datetime | StreamType::Ipv4 => u32::MAX.into(),
        StreamType::Uint64 => u64::MAX,
        _ => return None,
    })
}

/// The values of one column that are accepted without the full [`check_value`]: the column's
/// plain integer or byte kind, worked out once per batch instead of by walking the type for
/// every value. A value it does not take goes through the full check, so that every refusal
/// (and every rarer type) keeps one wording and one set of rules.
#[derive(Clone, Copy, Debug, PartialEq)]
enum FastRule {
    /// Unsigned values up to the maximum (`Null` too when `nullable`).
    Uint { max: u64, nullable: bool },
    /// Signed values within the range.
    Int { min: i64, max: i64, nullable: bool },
    /// Any bytes (`string`).
    Bytes { nullable: bool },
    /// Nothing: every value takes the full check.
    Full,
}

impl FastRule {
    fn of(ty: &StreamType) -> FastRule {
        let nullable = ty.is_optional();
        let inner = ty.inner();
        if inner.is_packed() {
            return FastRule::Full;
        }
        if let Some(max) = unsigned_max(inner) {
            return FastRule::Uint { max, nullable };
        }
        if let Some((min, max)) = signed_range(inner) {
            return FastRule::Int { min, max, nullable };
        }
        match inner {
            StreamType::String => FastRule::Bytes { nullable },
            _ => FastRule::Full,
        }
    }

    /// The cell of `value` when the rule takes it (strings as a placeholder, as `check_value`).
    #[inline]
    fn accept(self, value: Value<'_>) -> Option<Cell> {
        match (self, value) {
            (FastRule::Uint { max, .. }, Value::Uint(v)) if v <= max => Some(Cell::Uint(v)),
            (FastRule::Int { min, max, .. }, Value::Int(v)) if min <= v && v <= max => {
                Some(Cell::Int(v))
            }
            (FastRule::Bytes { .. }, Value::Bytes(_)) => Some(Cell::Bytes { start: 0, len: 0 }),
            (
                FastRule::Uint { nullable: true, .. }
                | FastRule::Int { nullable: true, .. }
                | FastRule::Bytes { nullable: true },
                Value::Null,
            ) => Some(Cell::Null),
            _ => None,
        }
    }
}

/// The range of a signed stream type.
fn signed_range(ty: &StreamType) -> Option<(i64, i64)> {
    Some(match ty {
        StreamType::Int8 => (i8::MIN.into(), i8::MAX.into()),
        StreamType::Int16 => (i16::MIN.into(), i16::MAX.into()),
        StreamType::Int32 => (i32::MIN.into(), i32::MAX.into()),
        StreamType::Int64 | StreamType::Timestamp => (i64::MIN, i64::MAX),
        _ => return None,
    })
}

/// The checks of a column value, for the items of packed values (`crate::json_form`).
pub(crate) fn check_item(ty: &StreamType, value: Value<'_>) -> Result<(), String> {
    check_value(ty, value).map(|_| ())
}

fn check_value(ty: &StreamType, value: Value<'_>) -> Result<Cell, String> {
    if let Value::Null = value {
        return if ty.is_optional() {
            Ok(Cell::Null)
        } else {
            Err("null in a column that is not optional".to_owned())
        };
    }
    let inner = ty.inner();
    let out_of_range = |v: &dyn fmt::Display| inner.out_of_range(v);
    if inner.is_packed() {
        let Value::Packed(bytes) = value else {
            return Err(format!("expected {inner}, got {}", value.kind()));
        };
        crate::packed::validate(inner, bytes).map_err(|err| err.0)?;
        return Ok(Cell::Packed { start: 0, len: 0 });
    }
    match (inner, value) {
        (StreamType::Date32, Value::Int(v)) => {
            crate::packed::check_date32(v)?;
            Ok(Cell::Int(v))
        }
        (StreamType::Date32, Value::Uint(v)) => {
            let v = i64::try_from(v).map_err(|_| out_of_range(&v))?;
            crate::packed::check_date32(v)?;
            Ok(Cell::Int(v))
        }
        (StreamType::Float | StreamType::Double, Value::Float(v)) => Ok(Cell::Float(v)),
        // Integers are accepted where floats are declared: JSON does not tell `1` from `1.0`.
        (StreamType::Float | StreamType::Double, Value::Int(v)) => Ok(Cell::Float(v as f64)),
        (StreamType::Float | StreamType::Double, Value::Uint(v)) => Ok(Cell::Float(v as f64)),
        (StreamType::Boolean, Value::Bool(v)) => Ok(Cell::Bool(v)),
        (StreamType::String, Value::Bytes(_)) => Ok(Cell::Bytes { start: 0, len: 0 }),
        (StreamType::Utf8, Value::Bytes(bytes)) => match std::str::from_utf8(bytes) {
            Ok(_) => Ok(Cell::Bytes { start: 0, len: 0 }),
            Err(err) => Err(format!("not valid UTF-8 ({err})")),
        },
        // Same-signedness values are checked in 64 bits and stored as they came; only the rare
        // cross-sign case widens (this runs once per value, so it stays branch-light).
        (_, Value::Uint(v)) if let Some(max) = unsigned_max(inner) => {
            if v <= max {
                Ok(Cell::Uint(v))
            } else {
                Err(out_of_range(&v))
            }
        }
        (_, Value::Int(v)) if let Some((min, max)) = signed_range(inner) => {
            if (min..=max).contains(&v) {
                Ok(Cell::Int(v))
            } else {
                Err(out_of_range(&v))
            }
        }
        (_, Value::Int(_) | Value::Uint(_)) => {
            let Some((min, max)) = inner.integer_range() else {
                return Err(format!("expected {inner}, got {}", value.kind()));
            };
            let wide: i128 = match value {
                Value::Int(v) => v.into(),
                Value::Uint(v) => v.into(),
                _ => 0,
            };
            if wide < min || wide > max {
                return Err(out_of_range(&wide));
            }
            // The range check above makes both conversions lossless.
            Ok(if inner.is_signed_integer() {
                Cell::Int(wide as i64)
            } else {
                Cell::Uint(wide as u64)
            })
        }
        (expected, got) => Err(format!("expected {expected}, got {}", got.kind())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::Column;

    fn schema() -> Arc<StreamSchema> {
        StreamSchema::new(vec![
            Column::new("id", StreamType::Uint64),
            Column::new("small", StreamType::Int8),
            Column::new("name", StreamType::Optional(Box::new(StreamType::Utf8))),
        ])
        .unwrap()
    }

    #[test]
    fn the_fast_rule_takes_only_what_the_full_check_takes_and_stores_the_same_cell() {
        let types = [
            "uint8",
            "uint16",
            "uint32",
            "uint64",
            "int8",
            "int16",
            "int32",
            "int64",
            "date",
            "datetime",
            "timestamp",
            "ipv4",
            "string",
            "utf8",
            "boolean",
            "double",
            "date32",
            "uint128",
            "decimal(9,2)",
        ];
        let values = [
            Value::Null,
            Value::Uint(0),
            Value::Uint(255),
            Value::Uint(256),
            Value::Uint(65_536),
            Value::Uint(u64::from(u32::MAX) + 1),
            Value::Uint(u64::MAX),
            Value::Int(-129),
            Value::Int(-1),
            Value::Int(127),
            Value::Int(i64::MIN),
            Value::Int(i64::MAX),
            Value::Float(1.5),
            Value::Bool(true),
            Value::Bytes(b"text"),
            Value::Bytes(&[0xff, 0xfe]),
            Value::Packed(&[0; 16]),
        ];
        let mut taken = 0;
        for name in types {
            let plain: StreamType = name.parse().unwrap();
            for ty in [plain.clone(), StreamType::Optional(Box::new(plain))] {
                let rule = FastRule::of(&ty);
                for value in values {
                    let Some(fast) = rule.accept(value) else {
                        continue;
                    };
                    taken += 1;
                    assert_eq!(
                        check_value(&ty, value).ok(),
                        Some(fast),
                        "{ty} {value:?}: the fast rule took what the full check does not, or stored another cell"
                    );
                }
            }
        }
        // Every plain integer and string column takes its in-range values of its own sign without
        // the full check: 46 (type, value) pairs, as plain and as optional columns, plus `null` in
        // each of the 13 optional ones.
        assert_eq!(taken, 2 * 46 + 13);
    }

    #[test]
    fn bytes_written_in_place_are_checked_and_stored_as_pushed_bytes_are() {
        let types = [
            "string",
            "utf8",
            "optional<utf8>",
            "uuid",
            "ipv4",
            "uint64",
            "decimal(9,2)",
        ];
        let values: [&[u8]; 5] = [
            b"text",
            &[0xff, 0xfe],
            b"",
            b"01234567-89ab-cdef-0123-456789abcdef",
            b"12.5",
        ];
        let (mut stored, mut refused) = (0, 0);
        for name in types {
            let ty: StreamType = name.parse().unwrap();
            let schema = StreamSchema::new(vec![
                Column::new("c", ty.clone()),
                Column::new("after", StreamType::String),
            ])
            .unwrap();
            for bytes in values {
                let (mut pushed, mut in_place) = (
                    MessageBatch::new(schema.clone()),
                    MessageBatch::new(schema.clone()),
                );
                let mut a = pushed.start_row(MessageId::new(0, 0));
                let mut b = in_place.start_row(MessageId::new(0, 0));
                let expected = a
                    .push(Value::Bytes(bytes))
                    .map(|_| ())
                    .map_err(|e| e.to_string());
                let got = b
                    .push_bytes_with(|arena| arena.extend_from_slice(bytes))
                    .map(|_| ())
                    .map_err(|e| e.to_string());
                assert_eq!(got, expected, "{ty} {bytes:?}");
                assert_eq!(b.written_bytes(), a.written_bytes(), "{ty} {bytes:?}");
                if expected.is_err() {
                    refused += 1;
                    continue;
                }
                stored += 1;
                for row in [&mut a, &mut b] {
                    row.push(Value::Bytes(b"next")).unwrap();
                }
                a.finish().unwrap();
                b.finish().unwrap();
                assert_eq!(
                    in_place.row(0).values().collect::<Vec<_>>(),
                    pushed.row(0).values().collect::<Vec<_>>(),
                    "{ty} {bytes:?}"
                );
            }
        }
        // Every value of the three string columns except the invalid UTF-8 in the two `utf8`
        // ones; the other types take no bytes.
        assert_eq!((stored, refused), (5 + 4 + 4, 35 - 13));
    }

    #[test]
    fn message_id_prints_and_parses_as_partition_dash_offset() {
        let id = MessageId::new(3, 17);
        assert_eq!(id.to_string(), "3-17");
        assert_eq!("3-17".parse::<MessageId>().unwrap(), id);
        assert!("3_17".parse::<MessageId>().is_err());
        assert!(MessageId::new(0, 9) < MessageId::new(0, 10));
    }

    #[test]
    fn rows_round_trip_values_in_schema_order() {
        let mut batch = MessageBatch::new(schema());
        let mut row = batch.start_row(MessageId::new(0, 0));
        row.push(Value::Uint(7)).unwrap();
        row.push(Value::Int(-5)).unwrap();
        row.push(Value::Bytes(b"ann")).unwrap();
        row.finish().unwrap();
        let mut row = batch.start_row(MessageId::new(0, 1));
        row.push(Value::Uint(8)).unwrap();
        row.push(Value::Int(6)).unwrap();
        row.push(Value::Null).unwrap();
        row.finish().unwrap();
        assert_eq!(batch.len(), 2);
        let values: Vec<Value<'_>> = batch.row(0).values().collect();
        assert_eq!(
            values,
            vec![Value::Uint(7), Value::Int(-5), Value::Bytes(b"ann")]
        );
        assert_eq!(batch.row(1).get(2), Value::Null);
        assert_eq!(batch.row(1).id(), MessageId::new(0, 1));
    }

    #[test]
    fn a_bounded_batch_reserves_its_bound_once_its_first_messages_show_their_bytes() {
        let bound = 10_000;
        let mut batch = MessageBatch::new(schema()).bounded(bound);
        let mut capacities = Vec::new();
        for offset in 0..bound as u64 {
            let mut row = batch.start_row(MessageId::new(0, offset));
            row.push(Value::Uint(offset)).unwrap();
            row.push(Value::Int(1)).unwrap();
            row.push(Value::Bytes(b"twenty bytes of text")).unwrap();
            row.finish().unwrap();
            let now = (batch.ids.capacity(), batch.cells.capacity());
            if capacities.last() != Some(&now) {
                capacities.push(now);
            }
        }
        // Room for the first 1024 messages, then for the bound and an eighth: two sizes, no
        // doubling.
        let room = bound + bound / 8;
        assert_eq!(capacities, vec![(1024, 3 * 1024), (room, 3 * room)]);
        // The arena: 20 bytes a message, projected to the bound with an eighth more.
        assert_eq!(batch.arena.len(), 20 * bound);
        assert_eq!(batch.arena.capacity(), 20 * bound + 20 * bound / 8);
        // Clearing a batch filled to its bound keeps its room: nothing is reallocated.
        let at = (
            batch.ids.as_ptr(),
            batch.cells.as_ptr(),
            batch.arena.as_ptr(),
        );
        batch.clear();
        assert_eq!(
            (
                batch.ids.as_ptr(),
                batch.cells.as_ptr(),
                batch.arena.as_ptr()
            ),
            at
        );
        assert_eq!(batch.ids.capacity(), room);
    }

    #[test]
    fn rejected_value_leaves_the_batch_unchanged() {
        let mut batch = MessageBatch::new(schema());
        let mut row = batch.start_row(MessageId::new(0, 0));
        row.push(Value::Uint(1)).unwrap();
        let err = row.push(Value::Int(300)).map(|_| ()).unwrap_err();
        assert_eq!(
            err.to_string(),
            "column `small` (int8): 300 is out of range for int8 (-128 to 127)"
        );
        drop(row);
        assert_eq!(batch.len(), 0);
        assert_eq!(batch.cells.len(), 0);
        assert_eq!(batch.arena_bytes(), 0);
    }

    #[test]
    fn null_into_required_column_and_wrong_kind_are_rejected() {
        let mut batch = MessageBatch::new(schema());
        let mut row = batch.start_row(MessageId::new(0, 0));
        let err = row.push(Value::Null).map(|_| ()).unwrap_err();
        assert_eq!(
            err.to_string(),
            "column `id` (uint64): null in a column that is not optional"
        );
        let err = row.push(Value::Bytes(b"x")).map(|_| ()).unwrap_err();
        assert_eq!(
            err.to_string(),
            "column `id` (uint64): expected uint64, got a string"
        );
        let err = row.push(Value::Int(-1)).map(|_| ()).unwrap_err();
        assert_eq!(
            err.to_string(),
            "column `id` (uint64): -1 is out of range for uint64 (0 to 18446744073709551615)"
        );
    }

    #[test]
    fn integers_cross_sign_boundaries_only_where_they_fit() {
        let schema = StreamSchema::new(vec![
            Column::new("i", StreamType::Int64),
            Column::new("u", StreamType::Uint64),
            Column::new("b", StreamType::Boolean),
        ])
        .unwrap();
        let mut batch = MessageBatch::new(schema);
        let mut row = batch.start_row(MessageId::new(0, 0));
        let err = row.push(Value::Uint(u64::MAX)).map(|_| ()).unwrap_err();
        assert_eq!(
            err.to_string(),
            "column `i` (int64): 18446744073709551615 is out of range for int64 (-9223372036854775808 to 9223372036854775807)"
        );
        row.push(Value::Uint(7)).unwrap();
        row.push(Value::Int(i64::MAX)).unwrap();
        let err = row.push(Value::Int(1)).map(|_| ()).unwrap_err();
        assert_eq!(
            err.to_string(),
            "column `b` (boolean): expected boolean, got a signed integer"
        );
        row.push(Value::Bool(true)).unwrap();
        row.finish().unwrap();
        let values: Vec<_> = batch.row(0).values().collect();
        assert_eq!(
            values,
            [
                Value::Int(7),
                Value::Uint(i64::MAX as u64),
                Value::Bool(true)
            ]
        );
    }

    #[test]
    fn incomplete_row_is_rejected_by_finish() {
        let mut batch = MessageBatch::new(schema());
        let mut row = batch.start_row(MessageId::new(0, 0));
        row.push(Value::Uint(1)).unwrap();
        let err = row.finish().unwrap_err();
        assert_eq!(err.to_string(), "row has 1 of 3 values");
        assert!(batch.is_empty());
    }
}
