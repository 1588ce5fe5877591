//! ClickHouse column types as `system.columns.type` prints them, and the check that a stream
//! column may be written to a table column (`check_mapping`, the type table of
//! docs/clickhouse.md), once per session, before the first row.

use std::fmt;

use flow_core::{StreamType, TypeExprCursor};

/// A ClickHouse column type as `system.columns.type` prints it.
///
/// Only the types the sink can write are modelled; everything else is kept verbatim as
/// [`ChType::Unsupported`], as is a wrapping ClickHouse itself refuses (`Nullable(Array(T))`,
/// `Nullable(Nullable(T))`, `LowCardinality(Array(T))`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ChType {
    /// `Int8`: signed 8-bit integer.
    Int8,
    /// `Int16`: signed 16-bit integer.
    Int16,
    /// `Int32`: signed 32-bit integer.
    Int32,
    /// `Int64`: signed 64-bit integer.
    Int64,
    /// `UInt8`: unsigned 8-bit integer.
    UInt8,
    /// `UInt16`: unsigned 16-bit integer.
    UInt16,
    /// `UInt32`: unsigned 32-bit integer.
    UInt32,
    /// `UInt64`: unsigned 64-bit integer.
    UInt64,
    /// `Int128`: signed 128-bit integer.
    Int128,
    /// `UInt128`: unsigned 128-bit integer.
    UInt128,
    /// `Int256`: signed 256-bit integer.
    Int256,
    /// `UInt256`: unsigned 256-bit integer.
    UInt256,
    /// `Float32`.
    Float32,
    /// `Float64`.
    Float64,
    /// `String`: arbitrary bytes.
    String,
    /// `FixedString(N)`: exactly `N` bytes.
    FixedString(usize),
    /// `LowCardinality(T)`: dictionary-encoded `T`, written as `T` is.
    LowCardinality(Box<ChType>),
    /// `Bool`.
    Bool,
    /// `Date`: days since 1970-01-01, 16 bits unsigned.
    Date,
    /// `Date32`: days since 1970-01-01, 32 bits signed.
    Date32,
    /// `DateTime` with or without a time zone argument. The zone only changes how ClickHouse
    /// prints the value, never the stored seconds, so it is not kept.
    DateTime,
    /// `DateTime64(precision[, zone])`: ticks of 10^-precision s (the zone is not kept either).
    DateTime64(u8),
    /// `Decimal(P, S)` (and `Decimal32/64/128/256(S)`).
    Decimal {
        /// Total digits, 1..=76.
        precision: u8,
        /// Digits after the point, 0..=precision.
        scale: u8,
    },
    /// `UUID`.
    Uuid,
    /// `IPv4`.
    IPv4,
    /// `IPv6`.
    IPv6,
    /// Names and values in declaration order.
    Enum8(Vec<(String, i8)>),
    /// `Enum16`: names and values in declaration order.
    Enum16(Vec<(String, i16)>),
    /// `Nullable(T)`.
    Nullable(Box<ChType>),
    /// `Array(T)`.
    Array(Box<ChType>),
    /// `Tuple(T1, ...)`, unnamed or named (names are not kept).
    Tuple(Vec<ChType>),
    /// `Map(K, V)`.
    Map(Box<ChType>, Box<ChType>),
    /// `Variant(T1, ...)` in the order `system.columns` prints it: sorted by type name, so a
    /// variant's place in the list is its RowBinary discriminator (255 is NULL).
    Variant(Vec<ChType>),
    /// `Dynamic` or `Dynamic(max_types=N)`: each value carries its own type (binary type code).
    Dynamic,
    /// `JSON` with or without arguments (typed paths, `max_dynamic_paths`, `SKIP`): written as the
    /// JSON object's text under `input_format_binary_read_json_as_string = 1`; the server parses
    /// the typed paths.
    Json,
    /// `Time`: signed seconds, shown as `[-]HHH:MM:SS`, ±999:59:59.
    Time,
    /// `Time64(P)`: signed ticks of 10^-P s, ±999:59:59.(P nines).
    Time64(u8),
    /// Any other type, with the text it was parsed from.
    Unsupported(String),
}

impl ChType {
    /// Parses e.g. "Nullable(FixedString(16))", "LowCardinality(Nullable(String))",
    /// "DateTime('UTC')", "Decimal(18, 4)", "Enum8('a' = 1, 'b' = 2)",
    /// "Array(Nullable(Decimal(18, 4)))", "Map(String, Array(UInt32))", "Tuple(a UInt8, String)".
    /// Anything else, and any type holding an unsupported one, is `Unsupported(original text)`.
    /// Never fails.
    pub fn parse(text: &str) -> ChType {
        let mut parser = Parser {
            lex: TypeExprCursor::new(text),
        };
        match parser.parse_type() {
            Some(ty) if parser.lex.is_done() => ty,
            _ => ChType::Unsupported(text.to_owned()),
        }
    }

    /// Whether the column accepts NULL: `Nullable(T)` or `LowCardinality(Nullable(T))`.
    pub fn is_nullable(&self) -> bool {
        match self {
            ChType::Nullable(_) => true,
            ChType::LowCardinality(inner) => inner.is_nullable(),
            _ => false,
        }
    }

    fn is_composite(&self) -> bool {
        matches!(
            self,
            ChType::Nullable(_)
                | ChType::LowCardinality(_)
                | ChType::Array(_)
                | ChType::Tuple(_)
                | ChType::Map(..)
                | ChType::Variant(_)
                | ChType::Dynamic
                | ChType::Json
                | ChType::Unsupported(_)
        )
    }

    /// Whether the type is, or holds, a `JSON` column's type: its INSERT then needs
    /// `input_format_binary_read_json_as_string = 1`.
    pub fn holds_json(&self) -> bool {
        match self {
            ChType::Json => true,
            ChType::Nullable(inner) | ChType::LowCardinality(inner) | ChType::Array(inner) => {
                inner.holds_json()
            }
            ChType::Tuple(items) | ChType::Variant(items) => items.iter().any(ChType::holds_json),
            ChType::Map(key, value) => key.holds_json() || value.holds_json(),
            _ => false,
        }
    }

    /// The name of the type family, as `system.data_type_families` lists it.
    pub fn family(&self) -> &'static str {
        match self {
            ChType::Int8 => "Int8",
            ChType::Int16 => "Int16",
            ChType::Int32 => "Int32",
            ChType::Int64 => "Int64",
            ChType::UInt8 => "UInt8",
            ChType::UInt16 => "UInt16",
            ChType::UInt32 => "UInt32",
            ChType::UInt64 => "UInt64",
            ChType::Int128 => "Int128",
            ChType::UInt128 => "UInt128",
            ChType::Int256 => "Int256",
            ChType::UInt256 => "UInt256",
            ChType::Float32 => "Float32",
            ChType::Float64 => "Float64",
            ChType::String => "String",
            ChType::FixedString(_) => "FixedString",
            ChType::LowCardinality(_) => "LowCardinality",
            ChType::Bool => "Bool",
            ChType::Date => "Date",
            ChType::Date32 => "Date32",
            ChType::DateTime => "DateTime",
            ChType::DateTime64(_) => "DateTime64",
            ChType::Decimal { .. } => "Decimal",
            ChType::Uuid => "UUID",
            ChType::IPv4 => "IPv4",
            ChType::IPv6 => "IPv6",
            ChType::Enum8(_) => "Enum8",
            ChType::Enum16(_) => "Enum16",
            ChType::Nullable(_) => "Nullable",
            ChType::Array(_) => "Array",
            ChType::Tuple(_) => "Tuple",
            ChType::Map(..) => "Map",
            ChType::Variant(_) => "Variant",
            ChType::Dynamic => "Dynamic",
            ChType::Json => "JSON",
            ChType::Time => "Time",
            ChType::Time64(_) => "Time64",
            ChType::Unsupported(_) => "",
        }
    }

    /// Every family the type uses, outermost first.
    pub fn families(&self, out: &mut Vec<&'static str>) {
        out.push(self.family());
        match self {
            ChType::Nullable(inner) | ChType::LowCardinality(inner) | ChType::Array(inner) => {
                inner.families(out)
            }
            ChType::Tuple(items) | ChType::Variant(items) => {
                items.iter().for_each(|item| item.families(out))
            }
            ChType::Map(key, value) => {
                key.families(out);
                value.families(out);
            }
            _ => {}
        }
    }
}

/// Recursive descent over a type text.
struct Parser<'a> {
    lex: TypeExprCursor<'a>,
}

impl<'a> Parser<'a> {
    fn boxed(&mut self) -> Option<Box<ChType>> {
        Some(Box::new(self.parse_type()?))
    }

    fn enum_items<T: std::str::FromStr>(&mut self) -> Option<Vec<(String, T)>> {
        let mut items = Vec::new();
        loop {
            let name = self.lex.quoted()?;
            if !self.lex.eat('=') {
                return None;
            }
            items.push((name, self.lex.signed()?));
            if !self.lex.eat(',') {
                return Some(items);
            }
        }
    }

    /// A tuple item may be named (`a UInt8`); the name is not kept.
    fn tuple_item(&mut self) -> Option<ChType> {
        let saved = self.lex;
        let word = self.lex.word();
        let after = self.lex.rest();
        let named = !word.is_empty()
            && after.starts_with(char::is_whitespace)
            && after
                .trim_start()
                .starts_with(|c: char| c.is_ascii_alphabetic());
        if !named {
            self.lex = saved;
        }
        self.parse_type()
    }

    fn parse_type(&mut self) -> Option<ChType> {
        let name = self.lex.word();
        if !self.lex.peek_is('(') {
            return Some(match name {
                "Int8" => ChType::Int8,
                "Int16" => ChType::Int16,
                "Int32" => ChType::Int32,
                "Int64" => ChType::Int64,
                "UInt8" => ChType::UInt8,
                "UInt16" => ChType::UInt16,
                "UInt32" => ChType::UInt32,
                "UInt64" => ChType::UInt64,
                "Int128" => ChType::Int128,
                "UInt128" => ChType::UInt128,
                "Int256" => ChType::Int256,
                "UInt256" => ChType::UInt256,
                "Float32" => ChType::Float32,
                "Float64" => ChType::Float64,
                "String" => ChType::String,
                "Bool" => ChType::Bool,
                "Date" => ChType::Date,
                "Date32" => ChType::Date32,
                "DateTime" => ChType::DateTime,
                "UUID" => ChType::Uuid,
                "IPv4" => ChType::IPv4,
                "IPv6" => ChType::IPv6,
                "Dynamic" => ChType::Dynamic,
                "JSON" => ChType::Json,
                "Time" => ChType::Time,
                _ => return None,
            });
        }
        self.lex.eat('(');
        if let Some(ty) = self.parse_modern(name) {
            return ty;
        }
        let ty = match name {
            "Nullable" => {
                let inner = self.parse_type()?;
                if inner.is_composite() {
                    return None;
                }
                ChType::Nullable(Box::new(inner))
            }
            "LowCardinality" => {
                let inner = self.parse_type()?;
                let allowed = |ty: &ChType| {
                    !ty.is_composite()
                        && !matches!(
                            ty,
                            ChType::Enum8(_) | ChType::Enum16(_) | ChType::Decimal { .. }
                        )
                };
                let ok = match &inner {
                    ChType::Nullable(scalar) => allowed(scalar),
                    scalar => allowed(scalar),
                };
                if !ok {
                    return None;
                }
                ChType::LowCardinality(Box::new(inner))
            }
            "FixedString" => {
                let n: usize = self.lex.number()?;
                if n == 0 {
                    return None;
                }
                ChType::FixedString(n)
            }
            "DateTime" => {
                self.lex.quoted()?;
                ChType::DateTime
            }
            "DateTime64" => {
                let precision: u8 = self.lex.number()?;
                if precision > 9 {
                    return None;
                }
                if self.lex.eat(',') {
                    self.lex.quoted()?;
                }
                ChType::DateTime64(precision)
            }
            "Decimal" | "Decimal32" | "Decimal64" | "Decimal128" | "Decimal256" => {
                let first: u8 = self.lex.number()?;
                let (precision, scale) = match name {
                    "Decimal" => {
                        if !self.lex.eat(',') {
                            return None;
                        }
                        (first, self.lex.number()?)
                    }
                    "Decimal32" => (9, first),
                    "Decimal64" => (18, first),
                    "Decimal128" => (38, first),
                    _ => (76, first),
                };
                if !(1..=76).contains(&precision) || scale > precision {
                    return None;
                }
                ChType::Decimal { precision, scale }
            }
            "Enum8" => ChType::Enum8(self.enum_items()?),
            "Enum16" => ChType::Enum16(self.enum_items()?),
            "Array" => ChType::Array(self.boxed()?),
            "Map" => {
                let key = self.boxed()?;
                if !self.lex.eat(',') {
                    return None;
                }
                ChType::Map(key, self.boxed()?)
            }
            "Tuple" => {
                let mut items = vec![self.tuple_item()?];
                while self.lex.eat(',') {
                    items.push(self.tuple_item()?);
                }
                ChType::Tuple(items)
            }
            _ => return None,
        };
        self.lex.eat(')').then_some(ty)
    }

    /// The types of ClickHouse 24 and later, after their `(`: `Some(parsed)` for one of them
    /// (`Some(None)` when its arguments do not parse), `None` for any other name.
    fn parse_modern(&mut self, name: &str) -> Option<Option<ChType>> {
        let ty = match name {
            "Variant" => {
                let mut items = vec![self.parse_type()];
                while self.lex.eat(',') {
                    items.push(self.parse_type());
                }
                // A Nullable or another Variant inside a Variant is refused by ClickHouse.
                let items: Option<Vec<ChType>> = items
                    .into_iter()
                    .map(|item| {
                        item.filter(|t| {
                            !matches!(
                                t,
                                ChType::Nullable(_) | ChType::Variant(_) | ChType::Dynamic
                            )
                        })
                    })
                    .collect();
                items
                    .filter(|items| items.len() <= 255)
                    .map(ChType::Variant)
            }
            "Time64" => self
                .lex
                .number::<u8>()
                .filter(|precision| *precision <= 9)
                .map(ChType::Time64),
            // `max_types=N`, typed paths, `SKIP ...`: nothing the encoder needs.
            "Dynamic" | "JSON" => self.skip_arguments().then_some(if name == "JSON" {
                ChType::Json
            } else {
                ChType::Dynamic
            }),
            _ => return None,
        };
        Some(ty.filter(|_| self.lex.eat(')')))
    }

    /// Skips to the `)` closing the arguments (not consumed), over nested parentheses and quoted
    /// names; false when there is none.
    fn skip_arguments(&mut self) -> bool {
        let rest = self.lex.rest();
        let mut depth = 0usize;
        let mut quote = None;
        for (at, c) in rest.char_indices() {
            match (quote, c) {
                (Some(q), c) if c == q => quote = None,
                (Some(_), _) => {}
                (None, '\'' | '`' | '"') => quote = Some(c),
                (None, '(') => depth += 1,
                (None, ')') if depth == 0 => {
                    self.lex = TypeExprCursor::new(&rest[at..]);
                    return true;
                }
                (None, ')') => depth -= 1,
                _ => {}
            }
        }
        false
    }
}

fn write_quoted(f: &mut fmt::Formatter<'_>, text: &str) -> fmt::Result {
    f.write_str("'")?;
    for c in text.chars() {
        match c {
            '\'' => f.write_str("\\'")?,
            '\\' => f.write_str("\\\\")?,
            c => write!(f, "{c}")?,
        }
    }
    f.write_str("'")
}

fn write_enum<T: fmt::Display>(
    f: &mut fmt::Formatter<'_>,
    name: &str,
    items: &[(String, T)],
) -> fmt::Result {
    write!(f, "{name}(")?;
    for (i, (item, value)) in items.iter().enumerate() {
        if i > 0 {
            f.write_str(", ")?;
        }
        write_quoted(f, item)?;
        write!(f, " = {value}")?;
    }
    f.write_str(")")
}

impl fmt::Display for ChType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ChType::FixedString(n) => write!(f, "FixedString({n})"),
            ChType::LowCardinality(inner) => write!(f, "LowCardinality({inner})"),
            ChType::Nullable(inner) => write!(f, "Nullable({inner})"),
            ChType::DateTime64(precision) => write!(f, "DateTime64({precision})"),
            ChType::Decimal { precision, scale } => write!(f, "Decimal({precision}, {scale})"),
            ChType::Enum8(items) => write_enum(f, "Enum8", items),
            ChType::Enum16(items) => write_enum(f, "Enum16", items),
            ChType::Array(inner) => write!(f, "Array({inner})"),
            ChType::Map(key, value) => write!(f, "Map({key}, {value})"),
            ChType::Time64(precision) => write!(f, "Time64({precision})"),
            ChType::Tuple(items) | ChType::Variant(items) => {
                f.write_str(if matches!(self, ChType::Tuple(_)) {
                    "Tuple("
                } else {
                    "Variant("
                })?;
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{item}")?;
                }
                f.write_str(")")
            }
            ChType::Unsupported(text) => f.write_str(text),
            other => f.write_str(other.family()),
        }
    }
}

/// What the servers of a sink know about types: their version and `system.data_type_families`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServerTypes {
    /// The server version, as `version()` returns it.
    pub version: String,
    /// Empty when unknown (every family is then assumed present).
    pub families: Vec<String>,
}

impl ServerTypes {
    fn lacks(&self, family: &str) -> bool {
        !self.families.is_empty()
            && !family.is_empty()
            && !self.families.iter().any(|f| f == family)
    }
}

/// Checks that a stream column can be written to a table column (docs/clickhouse.md has the
/// table). `optional<T>` fits `Nullable(T')` where T fits T', and also a non-Nullable T' (a null
/// is then refused per value, before sealing); a plain T fits `Nullable(T')` too.
/// `LowCardinality(T)` is written as T. Per-value checks (ranges, precision, enum names, IP and
/// UUID text) happen when rows are encoded.
///
/// A wider integer column that holds every value of the stream's type fits too (a widening). The error explains the fix, e.g. "column `user_id`: the stream has uint64
/// but the table has UInt32; declare the stream column as uint32 or change the table column to
/// UInt64"; when the
/// fitting column type is one the server lacks, it says so with the server's version.
#[cfg(any(test, feature = "testing"))]
pub fn check_mapping(column: &str, stream: &StreamType, table: &ChType) -> Result<(), String> {
    check_mapping_on(column, stream, table, &ServerTypes::default())
}

/// `check_mapping` against the types a server has.
pub fn check_mapping_on(
    column: &str,
    stream: &StreamType,
    table: &ChType,
    server: &ServerTypes,
) -> Result<(), String> {
    if let ChType::Unsupported(_) = table {
        return Err(format!(
            "column `{column}`: the table type {table} is not supported by the ClickHouse \
             sink; drop the column from the stream (the table then fills in its DEFAULT) or \
             change the table column to a supported type"
        ));
    }
    if contains_unsupported(table) {
        return Err(format!(
            "column `{column}`: the table type {table} holds a type the ClickHouse sink does \
             not support; drop the column from the stream or change the table column"
        ));
    }
    if fits(stream, table) {
        return Ok(());
    }
    let table_fix = fitting_table_type(stream, table);
    let stream_fix = stream_spelling(table, stream.is_optional());
    let mut message = format!(
        "column `{column}`: the stream has {stream} but the table has {table}; declare the \
         stream column as {stream_fix} or change the table column to {table_fix}"
    );
    let mut missing = Vec::new();
    ChType::parse(&table_fix).families(&mut missing);
    missing.retain(|family| server.lacks(family));
    missing.dedup();
    if !missing.is_empty() {
        message.push_str(&format!(
            " (ClickHouse {} has no {}: upgrade the server or keep the stream type)",
            server.version,
            missing.join(", ")
        ));
    }
    Err(message)
}

/// The column type `stream` is written to naturally, Nullable where `table` is.
fn fitting_table_type(stream: &StreamType, table: &ChType) -> String {
    let natural = natural_type(stream.inner());
    if table.is_nullable() && !natural.starts_with("Nullable") {
        format!("Nullable({natural})")
    } else {
        natural
    }
}

/// The column type to `MODIFY COLUMN` a `table` column to so that `stream` fits it, when the
/// server has that type (`None` when it lacks one of its families).
pub(crate) fn type_to_alter_to(
    stream: &StreamType,
    table: &ChType,
    server: &ServerTypes,
) -> Option<String> {
    let fix = fitting_table_type(stream, table);
    let mut families = Vec::new();
    ChType::parse(&fix).families(&mut families);
    (!families.iter().any(|family| server.lacks(family))).then_some(fix)
}

fn contains_unsupported(ty: &ChType) -> bool {
    match ty {
        ChType::Unsupported(_) => true,
        ChType::Nullable(inner) | ChType::LowCardinality(inner) | ChType::Array(inner) => {
            contains_unsupported(inner)
        }
        ChType::Tuple(items) | ChType::Variant(items) => items.iter().any(contains_unsupported),
        ChType::Map(key, value) => contains_unsupported(key) || contains_unsupported(value),
        _ => false,
    }
}

/// The variant a value of `stream` (under its `optional`) is written as: the first one that is
/// the stream type's natural column type, else the first one it fits, in the order the table
/// lists them. Decided by the types alone, so every value of a column goes to the same variant.
pub(crate) fn variant_for(stream: &StreamType, variants: &[ChType]) -> Option<usize> {
    let stream = stream.inner();
    variants
        .iter()
        .position(|v| is_natural(stream, v))
        .or_else(|| variants.iter().position(|v| fits(stream, v)))
}

/// Whether `table` is the column type `stream` is written to naturally ([`natural_type`]),
/// LowCardinality aside.
fn is_natural(stream: &StreamType, table: &ChType) -> bool {
    match (stream, table) {
        (_, ChType::LowCardinality(inner)) => is_natural(stream, inner),
        (StreamType::Optional(s), ChType::Nullable(t))
        | (StreamType::List(s), ChType::Array(t)) => is_natural(s, t),
        (StreamType::Dict(k, v), ChType::Map(tk, tv)) => is_natural(k, tk) && is_natural(v, tv),
        (StreamType::Tuple(items), ChType::Tuple(ts)) => {
            items.len() == ts.len() && items.iter().zip(ts).all(|(s, t)| is_natural(s, t))
        }
        (s, t) => natural_scalar(s).as_ref() == Some(t),
    }
}

/// The natural column type of a stream type that is not nested (`None` for `optional`, `list`,
/// `dict`, `tuple`); built without allocating, for the encoder's per-value use.
pub(crate) fn natural_scalar(stream: &StreamType) -> Option<ChType> {
    Some(match stream {
        StreamType::Int8 => ChType::Int8,
        StreamType::Int16 => ChType::Int16,
        StreamType::Int32 => ChType::Int32,
        StreamType::Int64 => ChType::Int64,
        StreamType::Uint8 => ChType::UInt8,
        StreamType::Uint16 => ChType::UInt16,
        StreamType::Uint32 => ChType::UInt32,
        StreamType::Uint64 => ChType::UInt64,
        StreamType::Int128 => ChType::Int128,
        StreamType::Uint128 => ChType::UInt128,
        StreamType::Int256 => ChType::Int256,
        StreamType::Uint256 => ChType::UInt256,
        StreamType::Float => ChType::Float32,
        StreamType::Double => ChType::Float64,
        StreamType::String | StreamType::Utf8 => ChType::String,
        StreamType::Boolean => ChType::Bool,
        StreamType::Date => ChType::Date,
        StreamType::Datetime => ChType::DateTime,
        StreamType::Date32 => ChType::Date32,
        StreamType::Timestamp => ChType::DateTime64(6),
        StreamType::Decimal { precision, scale } => ChType::Decimal {
            precision: *precision,
            scale: *scale,
        },
        StreamType::Uuid => ChType::Uuid,
        StreamType::Ipv4 => ChType::IPv4,
        StreamType::Ipv6 => ChType::IPv6,
        StreamType::Optional(_)
        | StreamType::List(_)
        | StreamType::Dict(..)
        | StreamType::Tuple(_) => return None,
    })
}

/// Whether every value of `stream` can be written as `table` (some only after a per-value check).
pub(crate) fn fits(stream: &StreamType, table: &ChType) -> bool {
    match (stream, table) {
        (_, ChType::LowCardinality(inner)) => fits(stream, inner),
        // Every value has a natural type, which Dynamic records with it; NULL is Nothing there.
        (_, ChType::Dynamic) => true,
        // NULL is the discriminator 255.
        (_, ChType::Variant(_)) => variant_for(
            stream,
            match table {
                ChType::Variant(variants) => variants,
                _ => &[],
            },
        )
        .is_some(),
        (StreamType::Optional(inner), ChType::Nullable(t)) => fits(inner, t),
        (StreamType::Optional(inner), _) => fits(inner, table),
        (_, ChType::Nullable(t)) => fits(stream, t),
        (StreamType::List(item), ChType::Array(t)) => fits(item, t),
        (StreamType::Dict(k, v), ChType::Map(tk, tv)) => fits(k, tk) && fits(v, tv),
        (StreamType::Tuple(items), ChType::Tuple(ts)) => {
            items.len() == ts.len() && items.iter().zip(ts).all(|(s, t)| fits(s, t))
        }
        (StreamType::Decimal { scale, .. }, ChType::Decimal { scale: s, .. }) => scale <= s,
        (s, t) => scalar_fits(s, t),
    }
}

fn scalar_fits(stream: &StreamType, table: &ChType) -> bool {
    is_widening(stream, table) || exact_fit(stream, table)
}

/// Whether `table` is a wider column than `stream`'s own type that holds every value of
/// `stream` and that the encoder writes exactly (a table column widened by `MODIFY COLUMN`
/// under a stream whose types are fixed, e.g. a generator's): an unsigned integer into a wider
/// unsigned or signed one, a signed one into a wider signed one, `float` into `Float64`. The
/// encoder converts each value to the column's width (`narrow`, 128/256-bit integers from any
/// 64-bit value; a `float` travels as the f64 of its f32, so Float64 keeps it bit for bit).
/// `date` into `DateTime` is not among them: days would have to become seconds.
pub(crate) fn is_widening(stream: &StreamType, table: &ChType) -> bool {
    use ChType as C;
    use StreamType as S;
    matches!(
        (stream, table),
        (
            S::Uint8,
            C::UInt16
                | C::UInt32
                | C::UInt64
                | C::UInt128
                | C::UInt256
                | C::Int16
                | C::Int32
                | C::Int64
                | C::Int128
                | C::Int256
        ) | (
            S::Uint16,
            C::UInt32
                | C::UInt64
                | C::UInt128
                | C::UInt256
                | C::Int32
                | C::Int64
                | C::Int128
                | C::Int256
        ) | (
            S::Uint32,
            C::UInt64 | C::UInt128 | C::UInt256 | C::Int64 | C::Int128 | C::Int256
        ) | (S::Uint64, C::UInt128 | C::UInt256 | C::Int128 | C::Int256)
            | (
                S::Int8,
                C::Int16 | C::Int32 | C::Int64 | C::Int128 | C::Int256
            )
            | (S::Int16, C::Int32 | C::Int64 | C::Int128 | C::Int256)
            | (S::Int32, C::Int64 | C::Int128 | C::Int256)
            | (S::Int64, C::Int128 | C::Int256)
            | (S::Float, C::Float64)
    )
}

/// The column type `stream` was written to before `table` was widened from it (see
/// [`is_widening`]), wrappers and arrays kept: `Nullable(UInt64)` for `optional<uint32>` gives
/// `Nullable(UInt32)`. `None` when no widening is involved, or only inside a tuple or map.
pub(crate) fn narrowed(stream: &StreamType, table: &ChType) -> Option<ChType> {
    match (stream, table) {
        (_, ChType::LowCardinality(inner)) => {
            narrowed(stream, inner).map(|t| ChType::LowCardinality(Box::new(t)))
        }
        (_, ChType::Nullable(inner)) => {
            narrowed(stream.inner(), inner).map(|t| ChType::Nullable(Box::new(t)))
        }
        (StreamType::Optional(item), _) => narrowed(item, table),
        (StreamType::List(item), ChType::Array(inner)) => {
            narrowed(item, inner).map(|t| ChType::Array(Box::new(t)))
        }
        (s, t) if is_widening(s, t) => Some(ChType::parse(&natural_type(s))),
        _ => None,
    }
}

fn exact_fit(stream: &StreamType, table: &ChType) -> bool {
    matches!(
        (stream, table),
        (StreamType::Int8, ChType::Int8)
            | (StreamType::Int16, ChType::Int16)
            | (StreamType::Int32, ChType::Int32)
            | (StreamType::Int64, ChType::Int64)
            | (StreamType::Uint8, ChType::UInt8)
            | (StreamType::Uint16, ChType::UInt16)
            | (StreamType::Uint32, ChType::UInt32)
            | (StreamType::Uint64, ChType::UInt64)
            | (StreamType::Int128, ChType::Int128)
            | (StreamType::Uint128, ChType::UInt128)
            | (StreamType::Int256, ChType::Int256)
            | (StreamType::Uint256, ChType::UInt256)
            | (StreamType::Float, ChType::Float32)
            | (StreamType::Double, ChType::Float64)
            | (
                StreamType::String | StreamType::Utf8,
                ChType::String
                    | ChType::FixedString(_)
                    // By name, checked per value; UUIDs and IPs from their text, parsed per value.
                    | ChType::Enum8(_)
                    | ChType::Enum16(_)
                    | ChType::Uuid
                    | ChType::IPv4
                    | ChType::IPv6
            )
            | (StreamType::Int8, ChType::Enum8(_))
            | (StreamType::Int16, ChType::Enum16(_))
            | (StreamType::Boolean, ChType::Bool)
            // Servers before 21.12 have no Bool; UInt8 is how a boolean is stored there.
            | (StreamType::Boolean, ChType::UInt8)
            | (StreamType::Date, ChType::Date)
            | (StreamType::Date | StreamType::Date32, ChType::Date32)
            | (StreamType::Datetime, ChType::DateTime)
            | (StreamType::Timestamp | StreamType::Datetime, ChType::DateTime64(_))
            | (StreamType::Uuid, ChType::Uuid)
            // How IPs are stored on servers without the IPv4/IPv6 types.
            | (StreamType::Ipv4, ChType::IPv4 | ChType::UInt32 | ChType::IPv6)
            | (StreamType::Ipv6, ChType::IPv6)
            | (StreamType::Ipv6 | StreamType::Uuid, ChType::FixedString(16))
            // A JSON object's text; Time from its text too, checked and converted per value.
            | (
                StreamType::String | StreamType::Utf8,
                ChType::Json | ChType::Time | ChType::Time64(_)
            )
            // Seconds (Time) or ticks (Time64), in range per value.
            | (
                StreamType::Int8
                    | StreamType::Int16
                    | StreamType::Int32
                    | StreamType::Int64
                    | StreamType::Uint8
                    | StreamType::Uint16
                    | StreamType::Uint32
                    | StreamType::Uint64,
                ChType::Time | ChType::Time64(_)
            )
    )
}

/// The stream type(s) that fit the table type, for an error message.
fn stream_spelling(table: &ChType, optional: bool) -> String {
    let names: Vec<String> = match table {
        ChType::Nullable(inner) | ChType::LowCardinality(inner) => {
            return stream_spelling(inner, optional)
        }
        ChType::Int8 => vec!["int8".into()],
        ChType::Int16 => vec!["int16".into()],
        ChType::Int32 => vec!["int32".into()],
        ChType::Int64 => vec!["int64".into()],
        ChType::UInt8 => vec!["uint8".into()],
        ChType::UInt16 => vec!["uint16".into()],
        ChType::UInt32 => vec!["uint32".into()],
        ChType::UInt64 => vec!["uint64".into()],
        ChType::Int128 => vec!["int128".into()],
        ChType::UInt128 => vec!["uint128".into()],
        ChType::Int256 => vec!["int256".into()],
        ChType::UInt256 => vec!["uint256".into()],
        ChType::Float32 => vec!["float".into()],
        ChType::Float64 => vec!["double".into()],
        ChType::String | ChType::FixedString(_) => vec!["string".into(), "utf8".into()],
        ChType::Enum8(_) | ChType::Enum16(_) => vec!["string".into(), "utf8".into()],
        ChType::Bool => vec!["boolean".into()],
        ChType::Date => vec!["date".into()],
        ChType::Date32 => vec!["date32".into()],
        ChType::DateTime => vec!["datetime".into()],
        ChType::DateTime64(_) => vec!["timestamp".into()],
        ChType::Decimal { precision, scale } => vec![format!("decimal({precision},{scale})")],
        ChType::Uuid => vec!["uuid".into()],
        ChType::IPv4 => vec!["ipv4".into()],
        ChType::IPv6 => vec!["ipv6".into()],
        ChType::Json => vec!["string".into(), "utf8".into()],
        ChType::Time => vec!["int32".into(), "utf8".into()],
        ChType::Time64(_) => vec!["int64".into(), "utf8".into()],
        ChType::Dynamic => vec!["any type".into()],
        ChType::Variant(variants) => variants.iter().map(|v| stream_spelling(v, false)).collect(),
        ChType::Array(_) | ChType::Tuple(_) | ChType::Map(..) | ChType::Unsupported(_) => {
            vec![natural_stream(table)]
        }
    };
    names
        .iter()
        .map(|name| {
            if optional {
                format!("optional<{name}>")
            } else {
                name.clone()
            }
        })
        .collect::<Vec<_>>()
        .join(" or ")
}

/// The stream type a table type is written from, spelled out (nested types too).
fn natural_stream(table: &ChType) -> String {
    match table {
        ChType::Nullable(inner) => format!("optional<{}>", natural_stream(inner)),
        ChType::LowCardinality(inner) => natural_stream(inner),
        ChType::Array(inner) => format!("list<{}>", natural_stream(inner)),
        ChType::Map(key, value) => {
            format!("dict<{},{}>", natural_stream(key), natural_stream(value))
        }
        ChType::Tuple(items) => format!(
            "tuple<{}>",
            items
                .iter()
                .map(natural_stream)
                .collect::<Vec<_>>()
                .join(",")
        ),
        ChType::String | ChType::FixedString(_) | ChType::Enum8(_) | ChType::Enum16(_) => {
            "string".to_owned()
        }
        ChType::Unsupported(text) => text.clone(),
        other => stream_spelling(other, false),
    }
}

/// The column type `auto_add_columns` adds for a stream column of type `stream`: its natural
/// type, Nullable for an `optional<T>`.
pub(crate) fn column_type_to_add(stream: &StreamType) -> String {
    let natural = natural_type(stream.inner());
    if stream.is_optional() && !natural.starts_with("Nullable") {
        format!("Nullable({natural})")
    } else {
        natural
    }
}

/// The table type a stream type is written to naturally.
fn natural_type(stream: &StreamType) -> String {
    if let Some(scalar) = natural_scalar(stream) {
        return scalar.to_string();
    }
    match stream {
        StreamType::Optional(inner) => format!("Nullable({})", natural_type(inner)),
        StreamType::List(inner) => format!("Array({})", natural_type(inner)),
        StreamType::Dict(key, value) => {
            format!("Map({}, {})", natural_type(key), natural_type(value))
        }
        StreamType::Tuple(items) => format!(
            "Tuple({})",
            items
                .iter()
                .map(natural_type)
                .collect::<Vec<_>>()
                .join(", ")
        ),
        scalar => natural_scalar(scalar)
            .map(|t| t.to_string())
            .unwrap_or_default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opt(ty: StreamType) -> StreamType {
        StreamType::Optional(Box::new(ty))
    }

    fn nullable(ty: ChType) -> ChType {
        ChType::Nullable(Box::new(ty))
    }

    fn low(ty: ChType) -> ChType {
        ChType::LowCardinality(Box::new(ty))
    }

    /// The types as system.columns of ClickHouse 26.9.2.1 prints them.
    #[test]
    fn the_modern_types_parse_as_system_columns_prints_them() {
        for (text, parsed) in [
            ("JSON", ChType::Json),
            (
                "JSON(max_dynamic_paths=8, `a.b` UInt32, SKIP c, SKIP REGEXP 'x.*')",
                ChType::Json,
            ),
            ("Dynamic", ChType::Dynamic),
            ("Dynamic(max_types=4)", ChType::Dynamic),
            ("Time", ChType::Time),
            ("Time64(3)", ChType::Time64(3)),
            ("Array(JSON)", ChType::Array(Box::new(ChType::Json))),
            (
                "Variant(Array(UInt8), String, UInt64)",
                ChType::Variant(vec![
                    ChType::Array(Box::new(ChType::UInt8)),
                    ChType::String,
                    ChType::UInt64,
                ]),
            ),
        ] {
            assert_eq!(ChType::parse(text), parsed, "{text}");
        }
        assert_eq!(
            ChType::parse("Variant(Array(UInt8), String, UInt64)").to_string(),
            "Variant(Array(UInt8), String, UInt64)"
        );
        // ClickHouse refuses these itself; flow does not guess a layout for them.
        for text in [
            "Variant(Nullable(String), UInt8)",
            "Time64(10)",
            "JSON(a UInt8",
        ] {
            assert!(
                matches!(ChType::parse(text), ChType::Unsupported(_)),
                "{text}"
            );
        }
        assert!(ChType::parse("Map(String, Array(JSON))").holds_json());
        assert!(!ChType::parse("Variant(String, UInt64)").holds_json());
    }

    #[test]
    fn stream_types_fit_the_modern_types_they_can_be_written_as() {
        let fit = |stream: &str, table: &str| fits(&stream.parse().unwrap(), &ChType::parse(table));
        for (stream, table) in [
            ("string", "JSON"),
            ("uint64", "Variant(String, UInt64)"),
            ("optional<string>", "Variant(String, UInt64)"),
            ("uint8", "Variant(String, UInt64)"),
            ("list<dict<string,uint8>>", "Dynamic"),
            ("optional<double>", "Dynamic"),
            ("int32", "Time"),
            ("utf8", "Time64(3)"),
            ("int64", "Time64(6)"),
        ] {
            assert!(fit(stream, table), "{stream} into {table}");
        }
        for (stream, table) in [
            ("uint64", "JSON"),
            ("double", "Variant(String, UInt64)"),
            ("double", "Time"),
            ("list<uint8>", "Variant(String, UInt64)"),
        ] {
            assert!(!fit(stream, table), "{stream} into {table}");
        }
    }

    #[test]
    fn parse_plain_types_and_display_round_trips() {
        let cases = [
            ("Int8", ChType::Int8),
            ("Int16", ChType::Int16),
            ("Int32", ChType::Int32),
            ("Int64", ChType::Int64),
            ("UInt8", ChType::UInt8),
            ("UInt16", ChType::UInt16),
            ("UInt32", ChType::UInt32),
            ("UInt64", ChType::UInt64),
            ("Float32", ChType::Float32),
            ("Float64", ChType::Float64),
            ("String", ChType::String),
            ("FixedString(16)", ChType::FixedString(16)),
            ("Bool", ChType::Bool),
            ("Date", ChType::Date),
            ("DateTime", ChType::DateTime),
        ];
        for (text, ty) in cases {
            assert_eq!(ChType::parse(text), ty, "{text}");
            assert_eq!(ty.to_string(), text);
        }
    }

    #[test]
    fn parse_wrappers_including_nested_ones() {
        let cases = [
            (
                "Nullable(FixedString(16))",
                nullable(ChType::FixedString(16)),
            ),
            ("Nullable(UInt64)", nullable(ChType::UInt64)),
            ("Nullable(DateTime)", nullable(ChType::DateTime)),
            ("LowCardinality(String)", low(ChType::String)),
            (
                "LowCardinality(FixedString(2))",
                low(ChType::FixedString(2)),
            ),
            (
                "LowCardinality(Nullable(String))",
                low(nullable(ChType::String)),
            ),
            (
                "LowCardinality(Nullable(FixedString(3)))",
                low(nullable(ChType::FixedString(3))),
            ),
        ];
        for (text, ty) in cases {
            assert_eq!(ChType::parse(text), ty, "{text}");
            assert_eq!(ty.to_string(), text);
        }
    }

    #[test]
    fn parse_datetime_with_time_zone_and_whitespace() {
        assert_eq!(ChType::parse("DateTime('UTC')"), ChType::DateTime);
        assert_eq!(ChType::parse("DateTime('Europe/Moscow')"), ChType::DateTime);
        assert_eq!(
            ChType::parse("Nullable(DateTime('UTC'))"),
            nullable(ChType::DateTime)
        );
        assert_eq!(ChType::DateTime.to_string(), "DateTime");
        assert_eq!(
            ChType::parse(" Nullable( FixedString( 4 ) ) "),
            nullable(ChType::FixedString(4))
        );
    }

    #[test]
    fn parse_keeps_everything_else_as_unsupported_text() {
        for text in [
            "DateTime(UTC)",
            "DateTime('a'b')",
            "DateTime64(10)",
            "Decimal(77, 2)",
            "Decimal(4, 5)",
            "Enum8('a' = 1, 'b')",
            "Nullable(Nullable(UInt8))",
            "Nullable(LowCardinality(String))",
            "Nullable(Array(UInt8))",
            "LowCardinality(Array(String))",
            "LowCardinality(LowCardinality(String))",
            "LowCardinality(Decimal(9, 2))",
            "Array(Nothing)",
            "Array(UInt8",
            "Map(String)",
            "Tuple()",
            "AggregateFunction(sum, UInt64)",
            "FixedString(0)",
            "FixedString(+3)",
            "FixedString()",
            "Nullable(String",
            "string",
            "Boolean",
            "",
        ] {
            let ty = ChType::parse(text);
            assert_eq!(ty, ChType::Unsupported(text.to_owned()), "{text}");
            assert_eq!(ty.to_string(), text);
        }
    }

    #[test]
    fn parse_the_types_of_real_tables_and_print_them_as_clickhouse_does() {
        let cases = [
            ("Decimal(9, 2)", "Decimal(9, 2)"),
            ("Decimal(9,2)", "Decimal(9, 2)"),
            ("Decimal64(4)", "Decimal(18, 4)"),
            ("DateTime64(3)", "DateTime64(3)"),
            ("DateTime64(9, 'Europe/Moscow')", "DateTime64(9)"),
            ("UUID", "UUID"),
            ("IPv4", "IPv4"),
            ("IPv6", "IPv6"),
            ("Int128", "Int128"),
            ("UInt256", "UInt256"),
            ("Date32", "Date32"),
            (
                "Enum8('a' = 1, 'b\\'c' = -2)",
                "Enum8('a' = 1, 'b\\'c' = -2)",
            ),
            ("Enum16('x' = 1000)", "Enum16('x' = 1000)"),
            (
                "Array(Nullable(Decimal(18, 4)))",
                "Array(Nullable(Decimal(18, 4)))",
            ),
            ("Map(String, Array(UInt32))", "Map(String, Array(UInt32))"),
            ("Tuple(UInt8, String)", "Tuple(UInt8, String)"),
            (
                "Tuple(a UInt8, b Nullable(String))",
                "Tuple(UInt8, Nullable(String))",
            ),
            ("LowCardinality(UInt32)", "LowCardinality(UInt32)"),
            (
                "LowCardinality(Nullable(String))",
                "LowCardinality(Nullable(String))",
            ),
            ("Array(Array(Int8))", "Array(Array(Int8))"),
        ];
        for (text, printed) in cases {
            let ty = ChType::parse(text);
            assert!(!matches!(ty, ChType::Unsupported(_)), "{text}");
            assert_eq!(ty.to_string(), printed, "{text}");
            assert_eq!(ChType::parse(printed), ty, "{printed}");
        }
        assert_eq!(
            ChType::parse("Enum8('a' = 1, 'b\\'c' = -2)"),
            ChType::Enum8(vec![("a".to_owned(), 1), ("b'c".to_owned(), -2)])
        );
        assert_eq!(
            ChType::parse("Decimal(38, 10)"),
            ChType::Decimal {
                precision: 38,
                scale: 10
            }
        );
    }

    fn stream(text: &str) -> StreamType {
        text.parse().unwrap()
    }

    #[test]
    fn nested_and_wide_types_fit_their_columns() {
        for (s, t) in [
            (
                "list<optional<decimal(18,4)>>",
                "Array(Nullable(Decimal(18, 4)))",
            ),
            ("list<decimal(18,4)>", "Array(Nullable(Decimal(18, 4)))"),
            ("decimal(9,2)", "Decimal(18, 4)"),
            ("dict<utf8,list<uint32>>", "Map(String, Array(UInt32))"),
            ("optional<utf8>", "LowCardinality(Nullable(String))"),
            ("uint32", "LowCardinality(UInt32)"),
            (
                "tuple<uint8,optional<string>>",
                "Tuple(UInt8, Nullable(String))",
            ),
            ("utf8", "Enum8('a' = 1)"),
            ("int16", "Enum16('a' = 1)"),
            ("uuid", "UUID"),
            ("string", "UUID"),
            ("uuid", "FixedString(16)"),
            ("ipv4", "IPv4"),
            ("ipv4", "UInt32"),
            ("ipv6", "IPv6"),
            ("ipv6", "FixedString(16)"),
            ("utf8", "IPv6"),
            ("timestamp", "DateTime64(3)"),
            ("datetime", "DateTime64(0)"),
            ("date32", "Date32"),
            ("date", "Date32"),
            ("int128", "Int128"),
            ("uint256", "UInt256"),
            ("list<list<int8>>", "Array(Array(Int8))"),
        ] {
            assert_eq!(
                check_mapping("c", &stream(s), &ChType::parse(t)),
                Ok(()),
                "{s} -> {t}"
            );
        }
        for (s, t) in [
            ("decimal(9,4)", "Decimal(18, 2)"),
            ("tuple<uint8>", "Tuple(UInt8, String)"),
            ("dict<uint8,uint8>", "Map(String, UInt8)"),
            ("int128", "Int64"),
            ("uuid", "String"),
            ("timestamp", "DateTime"),
            ("int32", "Enum8('a' = 1)"),
            ("list<uint8>", "UInt8"),
        ] {
            assert!(
                check_mapping("c", &stream(s), &ChType::parse(t)).is_err(),
                "{s} -> {t}"
            );
        }
    }

    #[test]
    fn a_refusal_spells_the_nested_fix_and_names_a_type_the_server_lacks() {
        let server = ServerTypes {
            version: "18.16.1".to_owned(),
            families: [
                "Array", "Nullable", "Decimal", "DateTime", "String", "UInt32",
            ]
            .map(str::to_owned)
            .to_vec(),
        };
        assert_eq!(
            check_mapping_on(
                "at",
                &stream("timestamp"),
                &ChType::parse("DateTime"),
                &server
            ),
            Err(
                "column `at`: the stream has timestamp but the table has DateTime; declare the \
                 stream column as datetime or change the table column to DateTime64(6) \
                 (ClickHouse 18.16.1 has no DateTime64: upgrade the server or keep the stream \
                 type)"
                    .to_owned()
            )
        );
        assert_eq!(
            check_mapping_on(
                "tags",
                &stream("dict<utf8,list<uint64>>"),
                &ChType::parse("Array(UInt32)"),
                &server
            ),
            Err(
                "column `tags`: the stream has dict<utf8,list<uint64>> but the table has \
                 Array(UInt32); declare the stream column as list<uint32> or change the table \
                 column to Map(String, Array(UInt64)) (ClickHouse 18.16.1 has no Map, UInt64: \
                 upgrade the server or keep the stream type)"
                    .to_owned()
            )
        );
        // A server that has every family needed is not blamed.
        assert_eq!(
            check_mapping_on(
                "p",
                &stream("decimal(9,4)"),
                &ChType::parse("Decimal(9, 2)"),
                &server
            ),
            Err(
                "column `p`: the stream has decimal(9,4) but the table has Decimal(9, 2); \
                 declare the stream column as decimal(9,2) or change the table column to \
                 Decimal(9, 4)"
                    .to_owned()
            )
        );
    }

    #[test]
    fn check_mapping_accepts_every_row_of_the_reference_table() {
        let pairs = [
            (StreamType::Int8, ChType::Int8),
            (StreamType::Int16, ChType::Int16),
            (StreamType::Int32, ChType::Int32),
            (StreamType::Int64, ChType::Int64),
            (StreamType::Uint8, ChType::UInt8),
            (StreamType::Uint16, ChType::UInt16),
            (StreamType::Uint32, ChType::UInt32),
            (StreamType::Uint64, ChType::UInt64),
            (StreamType::Float, ChType::Float32),
            (StreamType::Double, ChType::Float64),
            (StreamType::String, ChType::String),
            (StreamType::Utf8, ChType::String),
            (StreamType::String, ChType::FixedString(8)),
            (StreamType::Utf8, ChType::FixedString(8)),
            (StreamType::String, low(ChType::String)),
            (StreamType::Utf8, low(ChType::String)),
            (StreamType::Boolean, ChType::Bool),
            (StreamType::Boolean, ChType::UInt8),
            (StreamType::Date, ChType::Date),
            (StreamType::Datetime, ChType::DateTime),
        ];
        for (stream, table) in pairs {
            // Exact, optional into Nullable, plain into Nullable, optional into plain.
            assert_eq!(check_mapping("c", &stream, &table), Ok(()));
            let null_table = if let ChType::LowCardinality(inner) = &table {
                low(nullable((**inner).clone()))
            } else {
                nullable(table.clone())
            };
            assert_eq!(
                check_mapping("c", &opt(stream.clone()), &null_table),
                Ok(())
            );
            assert_eq!(check_mapping("c", &stream, &null_table), Ok(()));
            assert_eq!(check_mapping("c", &opt(stream.clone()), &table), Ok(()));
        }
    }

    #[test]
    fn check_mapping_rejects_width_mismatch_with_the_fix() {
        assert_eq!(
            check_mapping("user_id", &StreamType::Uint64, &ChType::UInt32),
            Err(
                "column `user_id`: the stream has uint64 but the table has UInt32; declare the \
                 stream column as uint32 or change the table column to UInt64"
                    .to_owned()
            )
        );
        assert_eq!(
            check_mapping("n", &StreamType::Int64, &ChType::UInt64),
            Err(
                "column `n`: the stream has int64 but the table has UInt64; declare the stream \
                 column as uint64 or change the table column to Int64"
                    .to_owned()
            )
        );
    }

    #[test]
    fn a_column_widened_so_that_it_holds_every_stream_value_fits_and_names_its_narrow_type() {
        for (s, t, was) in [
            ("uint32", "UInt64", "UInt32"),
            ("uint8", "UInt16", "UInt8"),
            ("uint16", "Int32", "UInt16"),
            ("uint32", "Int64", "UInt32"),
            ("uint64", "UInt128", "UInt64"),
            ("uint64", "Int128", "UInt64"),
            ("int8", "Int64", "Int8"),
            ("int32", "Int64", "Int32"),
            ("int64", "Int256", "Int64"),
            ("float", "Float64", "Float32"),
            ("optional<uint32>", "Nullable(UInt64)", "Nullable(UInt32)"),
            ("uint32", "Nullable(UInt64)", "Nullable(UInt32)"),
            ("uint32", "LowCardinality(UInt64)", "LowCardinality(UInt32)"),
            ("list<uint32>", "Array(UInt64)", "Array(UInt32)"),
        ] {
            let (stream, table) = (stream(s), ChType::parse(t));
            assert_eq!(check_mapping("c", &stream, &table), Ok(()), "{s} -> {t}");
            assert_eq!(
                narrowed(&stream, &table)
                    .map(|ty| ty.to_string())
                    .as_deref(),
                Some(was),
                "{s} -> {t}"
            );
        }
        // What a stream value might not fit, or the encoder could not write exactly.
        for (s, t) in [
            ("uint64", "UInt32"),
            ("uint64", "Int64"),
            ("uint32", "Int32"),
            ("int8", "UInt16"),
            ("int32", "UInt64"),
            ("double", "Float32"),
            ("uint32", "Float64"),
            ("date", "DateTime"),
            ("uint8", "Bool"),
        ] {
            assert!(
                check_mapping("c", &stream(s), &ChType::parse(t)).is_err(),
                "{s} -> {t}"
            );
        }
        assert_eq!(narrowed(&stream("uint32"), &ChType::UInt32), None);
        assert_eq!(
            narrowed(&stream("tuple<uint32>"), &ChType::parse("Tuple(UInt64)")),
            None
        );
    }

    #[test]
    fn check_mapping_rejects_with_optional_and_nullable_in_the_fix() {
        assert_eq!(
            check_mapping(
                "score",
                &opt(StreamType::Double),
                &nullable(ChType::Float32)
            ),
            Err(
                "column `score`: the stream has optional<double> but the table has \
                 Nullable(Float32); declare the stream column as optional<float> or change the \
                 table column to Nullable(Float64)"
                    .to_owned()
            )
        );
        assert_eq!(
            check_mapping("name", &StreamType::Uint8, &low(nullable(ChType::String))),
            Err("column `name`: the stream has uint8 but the table has \
                 LowCardinality(Nullable(String)); declare the stream column as string or utf8 \
                 or change the table column to Nullable(UInt8)"
                .to_owned())
        );
        assert_eq!(
            check_mapping("flag", &StreamType::Boolean, &ChType::UInt16),
            Err(
                "column `flag`: the stream has boolean but the table has UInt16; declare the \
                 stream column as uint16 or change the table column to Bool"
                    .to_owned()
            )
        );
        assert_eq!(
            check_mapping("day", &StreamType::Datetime, &ChType::Date),
            Err(
                "column `day`: the stream has datetime but the table has Date; declare the \
                 stream column as date or change the table column to DateTime"
                    .to_owned()
            )
        );
    }

    #[test]
    fn check_mapping_rejects_unsupported_table_types() {
        let table = ChType::parse("AggregateFunction(sum, UInt64)");
        assert_eq!(
            check_mapping("total", &StreamType::Uint64, &table),
            Err(
                "column `total`: the table type AggregateFunction(sum, UInt64) is not supported \
                 by the ClickHouse sink; drop the column from the stream (the table then fills \
                 in its DEFAULT) or change the table column to a supported type"
                    .to_owned()
            )
        );
        for text in ["Nullable(Array(UInt8))", "LowCardinality(Decimal(9, 2))"] {
            assert!(check_mapping("c", &StreamType::String, &ChType::parse(text)).is_err());
        }
        // Hand-built wrappings ClickHouse would refuse are not supported either.
        assert!(check_mapping(
            "c",
            &StreamType::List(Box::new(StreamType::Uint32)),
            &ChType::Array(Box::new(ChType::Unsupported("Nothing".to_owned())))
        )
        .is_err());
    }
}
