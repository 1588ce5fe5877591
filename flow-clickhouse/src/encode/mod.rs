//! Encoding: ClickHouse types, the date ranges a server reads back, RowBinary bodies, reading rows back, compression, shard routing.

pub(crate) mod chtype;
pub(crate) mod compress;
pub(crate) mod readable;
pub(crate) mod routing;
pub(crate) mod row_spans;
pub(crate) mod rowbinary;
pub(crate) mod type_code;
pub(crate) mod widen;
