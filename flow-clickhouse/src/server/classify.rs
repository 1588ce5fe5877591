//! Classification of ClickHouse failures, in one place: which server error codes are transient
//! (retry), which are permanent (give up), and how the code is read from an HTTP response.
//!
//! The tables are those of the reference error-classification document, plus 252
//! `TOO_MANY_PARTS` (inserts are throttled until merges catch up) and 319
//! `UNKNOWN_STATUS_OF_INSERT` (the insert may or may not have landed; retrying with the same
//! deduplication token is the way to find out) as retryable. Any other code is
//! [`ErrorClass::Unknown`]: callers retry it a bounded number of times ([`crate::config::guarantee::should_retry`]) and log
//! it with [`log_unknown`] (`needs_classification = true`) so it can be added to a table.
//!
//! How the `clickhouse` crate (0.15) reports server errors: every failed HTTP response becomes
//! `Error::BadResponse(text)` where `text` is the response body, trimmed — `Code: 60. DB::Exception:
//! ...` on modern servers, `Code: 242, e.displayText() = DB::Exception: ...` on 18.16. Only when the
//! body is empty or unreadable does the crate fall back to the `X-ClickHouse-Exception-Code` header,
//! as the text `Code: <N>`, or to the status line (`503 Service Unavailable`). An exception in the
//! middle of a streamed response is also `BadResponse`, starting at its `Code:`.

use std::fmt;

/// What to do with a failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorClass {
    /// Transient: the same request is expected to succeed once the server or network recovers.
    Retryable,
    /// The same request will fail again; operator intervention is needed.
    Permanent,
    /// Not (yet) classified: retried a bounded number of times, logged with
    /// `needs_classification = true`.
    Unknown,
}

impl ErrorClass {
    /// The class's name in logs, status and metrics: `retryable`, `permanent` or `unclassified`.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorClass::Retryable => "retryable",
            ErrorClass::Permanent => "permanent",
            ErrorClass::Unknown => "unclassified",
        }
    }
}

impl fmt::Display for ErrorClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The retryable codes: the reference's retryable table plus 252 and 319, and two a 10-minute
/// endless run met when the server's disk filled and ZooKeeper went down with it: 75 (a write of
/// the server's own files failed, `No space left on device`) and 225 (no ZooKeeper session).
/// Both heal without any change on our side, and a replay is deduplicated. And 216: an attempt
/// of the same part is still running on that server ([`crate::delivery::insert`] names each
/// attempt after its token), so this one was refused unread and is made again once it ended.
pub const RETRYABLE_CODES: &[(u32, &str)] = &[
    (75, "CANNOT_WRITE_TO_FILE_DESCRIPTOR"),
    (159, "TIMEOUT_EXCEEDED"),
    (198, "DNS_ERROR"),
    (201, "QUOTA_EXPIRED"),
    (202, "TOO_MANY_SIMULTANEOUS_QUERIES"),
    (203, "NO_FREE_CONNECTION"),
    (209, "SOCKET_TIMEOUT"),
    (210, "NETWORK_ERROR"),
    (216, "QUERY_WITH_SAME_ID_IS_ALREADY_RUNNING"),
    (225, "NO_ZOOKEEPER"),
    (236, "ABORTED"),
    (241, "MEMORY_LIMIT_EXCEEDED"),
    (242, "TABLE_IS_READ_ONLY"),
    (243, "NOT_ENOUGH_SPACE"),
    (244, "UNEXPECTED_ZOOKEEPER_ERROR"),
    (252, "TOO_MANY_PARTS"),
    (254, "NO_ACTIVE_REPLICAS"),
    (265, "NO_AVAILABLE_REPLICA"),
    (279, "ALL_CONNECTION_TRIES_FAILED"),
    (285, "TOO_LESS_LIVE_REPLICAS"),
    (286, "UNSATISFIED_QUORUM_FOR_PREVIOUS_WRITE"),
    (289, "REPLICA_IS_NOT_IN_QUORUM"),
    (290, "LIMIT_EXCEEDED"),
    (297, "SHARD_HAS_NO_CONNECTIONS"),
    (319, "UNKNOWN_STATUS_OF_INSERT"),
    (364, "RECEIVED_ERROR_TOO_MANY_REQUESTS"),
    (384, "PART_IS_TEMPORARILY_LOCKED"),
    (999, "KEEPER_EXCEPTION"),
    (1000, "POCO_EXCEPTION"),
];

/// The permanent codes: the reference's permanent table, plus 395 (a `throwIf` in a column's
/// expression fired: a deterministic verdict on the rows sent, which a retry repeats) and 190 (a
/// row whose arrays of one `Nested` column differ in length, refused by 26.9 for that row: left
/// unknown, it was retried forever and the rest of its batch never landed).
pub const PERMANENT_CODES: &[(u32, &str)] = &[
    (6, "CANNOT_PARSE_TEXT"),
    (7, "INCORRECT_NUMBER_OF_COLUMNS"),
    (16, "NO_SUCH_COLUMN_IN_TABLE"),
    (18, "CANNOT_INSERT_ELEMENT_INTO_CONSTANT_COLUMN"),
    (20, "NUMBER_OF_COLUMNS_DOESNT_MATCH"),
    (25, "CANNOT_PARSE_ESCAPE_SEQUENCE"),
    (26, "CANNOT_PARSE_QUOTED_STRING"),
    (27, "CANNOT_PARSE_INPUT_ASSERTION_FAILED"),
    (38, "CANNOT_PARSE_DATE"),
    (41, "CANNOT_PARSE_DATETIME"),
    (43, "ILLEGAL_TYPE_OF_ARGUMENT"),
    (44, "ILLEGAL_COLUMN"),
    (47, "UNKNOWN_IDENTIFIER"),
    (53, "TYPE_MISMATCH"),
    (60, "UNKNOWN_TABLE"),
    (72, "CANNOT_PARSE_NUMBER"),
    (80, "INCORRECT_QUERY"),
    (81, "UNKNOWN_DATABASE"),
    (117, "INCORRECT_DATA"),
    (164, "READONLY"),
    (190, "SIZES_OF_ARRAYS_DONT_MATCH"),
    (192, "UNKNOWN_USER"),
    (193, "WRONG_PASSWORD"),
    (194, "REQUIRED_PASSWORD"),
    (195, "IP_ADDRESS_NOT_ALLOWED"),
    (291, "DATABASE_ACCESS_DENIED"),
    (321, "VALUE_IS_OUT_OF_RANGE_OF_DATA_TYPE"),
    (349, "CANNOT_INSERT_NULL_IN_ORDINARY_COLUMN"),
    (392, "QUERY_IS_PROHIBITED"),
    (395, "FUNCTION_THROW_IF_VALUE_IS_NON_ZERO"),
    (516, "AUTHENTICATION_FAILED"),
];

/// Codes that are about the target or the request, never about the rows sent: splitting a part
/// refused with one of them could only refuse every row, so the insert is given up instead
/// ([`is_row_rejection`]).
pub const TARGET_CODES: &[u32] = &[
    7, 16, 20, 47, 60, 62, 80, 81, 115, 164, 192, 193, 194, 195, 291, 392, 497, 516,
];

/// Permanent codes that are about the host that answered, not about the shard's table: a replica
/// whose table or database is detached or missing there (60, 81), a host configured read-only
/// for our user (164), or one whose users or grants differ (192-195, 291, 516). Another replica of
/// the same shard may take the same INSERT; only when every replica of the shard refuses is the
/// refusal permanent for the sink ([`is_replica_local`]). Each of them refuses the query before a
/// row is read, so a refused attempt stored nothing and a failover cannot double a row.
pub const REPLICA_LOCAL_CODES: &[u32] = &[60, 81, 164, 192, 193, 194, 195, 291, 516];

/// Codes of a body the server could not read as the columns it planned for (RowBinary cut short
/// or malformed for their types). The server reads a block before it writes it, and one INSERT of
/// this sink is one block, so an attempt refused with one of them stored nothing
/// ([`refused_unread`]).
pub const UNREAD_BODY_CODES: &[u32] = &[6, 25, 26, 27, 32, 33, 38, 41, 72];

/// Whether the server refused an attempt while reading its body, so that nothing of it was
/// stored ([`UNREAD_BODY_CODES`]).
pub fn refused_unread(err: &ClassifiedError) -> bool {
    err.code
        .is_some_and(|code| UNREAD_BODY_CODES.contains(&code))
}

/// What a replicated table answers (code 244, `UNEXPECTED_ZOOKEEPER_ERROR`) when the ZooKeeper
/// transaction that commits an inserted block failed with a definite answer: "Unexpected logical
/// error while adding block", "Unexpected ZooKeeper error while adding block", "Unrecoverable
/// network error while adding block". The server rolls the block back before it answers so, and
/// a transaction that may have gone through is answered with code 319 instead. Seen when a column
/// is altered while an INSERT commits: "... while adding block 6 with ID '...': Bad version,
/// path .../columns" (the transaction checks the columns' version).
const ROLLED_BACK_BLOCK_TEXT: &str = "while adding block";

/// Whether the server refused an attempt in a way that stored nothing of it, provided the INSERT
/// was one block: refused while reading its body ([`refused_unread`]), or its block's commit
/// rolled back ([`ROLLED_BACK_BLOCK_TEXT`]).
pub fn refused_unstored(err: &ClassifiedError) -> bool {
    refused_unread(err) || (err.code == Some(244) && err.message.contains(ROLLED_BACK_BLOCK_TEXT))
}

/// Names of a few frequent codes that are deliberately unclassified, for readable logs.
const OTHER_NAMED_CODES: &[(u32, &str)] = &[
    (32, "ATTEMPT_TO_READ_AFTER_EOF"),
    (33, "CANNOT_READ_ALL_DATA"),
    (36, "BAD_ARGUMENTS"),
    (62, "SYNTAX_ERROR"),
    (115, "UNKNOWN_SETTING"),
    (394, "QUERY_WAS_CANCELLED"),
    (497, "ACCESS_DENIED"),
    (1001, "STD_EXCEPTION"),
    (1002, "UNKNOWN_EXCEPTION"),
];

fn lookup(table: &[(u32, &'static str)], code: u32) -> Option<&'static str> {
    table
        .iter()
        .find(|(known, _)| *known == code)
        .map(|(_, name)| *name)
}

/// The class of a ClickHouse server error code.
pub fn classify_code(code: u32) -> ErrorClass {
    if lookup(RETRYABLE_CODES, code).is_some() {
        ErrorClass::Retryable
    } else if lookup(PERMANENT_CODES, code).is_some() {
        ErrorClass::Permanent
    } else {
        ErrorClass::Unknown
    }
}

/// Whether a failure that ended an insert may be caused by some of its rows, so that sending
/// them in smaller pieces can isolate them: the server refused the insert with an error code
/// that is neither transient nor about the target ([`TARGET_CODES`]). A failure without a code
/// (the connection, the columns guard) is never a row's fault.
pub fn is_row_rejection(err: &ClassifiedError) -> bool {
    match err.code {
        Some(code) => err.class != ErrorClass::Retryable && !TARGET_CODES.contains(&code),
        None => false,
    }
}

/// Whether a failure is one replica's refusal rather than the shard's: the server answered with a
/// permanent code of [`REPLICA_LOCAL_CODES`]. The insert fails over to the shard's other replicas
/// (`crate::delivery::insert`); a failure without a code is never replica-local.
pub fn is_replica_local(err: &ClassifiedError) -> bool {
    err.class == ErrorClass::Permanent
        && err
            .code
            .is_some_and(|code| REPLICA_LOCAL_CODES.contains(&code))
}

/// The symbolic name of a code we know, e.g. 242 => `TABLE_IS_READ_ONLY`.
pub fn code_name(code: u32) -> Option<&'static str> {
    lookup(RETRYABLE_CODES, code)
        .or_else(|| lookup(PERMANENT_CODES, code))
        .or_else(|| lookup(OTHER_NAMED_CODES, code))
}

/// Reads the ClickHouse error code: from the `X-ClickHouse-Exception-Code` header value if given
/// and numeric, else from the first `Code: N` in the body (18.16 sends no header), e.g.
/// `Code: 60, e.displayText() = DB::Exception: ...` or `Code: 60. DB::Exception: ...` => 60.
pub fn parse_code(header: Option<&str>, body: &str) -> Option<u32> {
    if let Some(code) = header.and_then(|value| value.trim().parse::<u32>().ok()) {
        return Some(code);
    }
    const MARKER: &str = "Code:";
    let mut search_from = 0;
    while let Some(found) = body[search_from..].find(MARKER) {
        let start = search_from + found;
        search_from = start + MARKER.len();
        // `Code:` must start a word: not `ErrorCode: 5`.
        let standalone = body[..start]
            .chars()
            .next_back()
            .is_none_or(|c| !c.is_ascii_alphanumeric() && c != '_');
        if !standalone {
            continue;
        }
        let rest = body[search_from..].trim_start_matches([' ', '\t']);
        let digits = rest
            .find(|c: char| !c.is_ascii_digit())
            .map_or(rest, |end| &rest[..end]);
        if let Ok(code) = digits.parse::<u32>() {
            return Some(code);
        }
    }
    None
}

/// The classified form of any failure of an insert or query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClassifiedError {
    /// Whether retrying can help.
    pub class: ErrorClass,
    /// The server's error code, when the failure came from the server with one.
    pub code: Option<u32>,
    /// The error's text, as the server or client gave it.
    pub message: String,
}

impl ClassifiedError {
    /// An error reported by the server; without a code it is [`ErrorClass::Unknown`].
    pub fn from_server(code: Option<u32>, message: impl Into<String>) -> Self {
        ClassifiedError {
            class: code.map_or(ErrorClass::Unknown, classify_code),
            code,
            message: message.into(),
        }
    }

    /// A transport failure (connection refused or reset, EOF, timeout): retryable, no code.
    pub fn network(message: impl Into<String>) -> Self {
        ClassifiedError {
            class: ErrorClass::Retryable,
            code: None,
            message: message.into(),
        }
    }

    /// A failure whose cause is not known to be transient or permanent.
    pub fn unknown(message: impl Into<String>) -> Self {
        ClassifiedError {
            class: ErrorClass::Unknown,
            code: None,
            message: message.into(),
        }
    }

    /// Maps a `clickhouse::error::Error`: `Network` and `TimedOut` are retryable; `BadResponse(text)`
    /// carries the server's response body (or `Code: N` from the exception-code header when the
    /// body is empty), whose code is parsed and classified; an `Other` wrapping an I/O error of a
    /// broken connection is retryable; everything else (compression, decompression, data format,
    /// schema mismatch, ...) is unknown.
    pub fn from_clickhouse(err: &clickhouse::error::Error) -> Self {
        if crate::server::protocol::tls_met_plain_text(err) {
            // Retrying cannot help: the configuration must change.
            return ClassifiedError {
                class: ErrorClass::Permanent,
                code: None,
                message: crate::server::protocol::TLS_TO_PLAIN.to_owned(),
            };
        }
        match err {
            clickhouse::error::Error::Network(_) | clickhouse::error::Error::TimedOut => {
                ClassifiedError::network(err.to_string())
            }
            clickhouse::error::Error::BadResponse(text) => {
                ClassifiedError::from_server(parse_code(None, text), text.clone())
            }
            clickhouse::error::Error::Other(inner) if is_connection_io_error(inner.as_ref()) => {
                ClassifiedError::network(err.to_string())
            }
            _ => ClassifiedError::unknown(err.to_string()),
        }
    }

    /// The symbolic name of the code, if known.
    pub fn code_name(&self) -> Option<&'static str> {
        self.code.and_then(code_name)
    }
}

/// An I/O error (anywhere in the source chain) that means the connection broke or timed out.
fn is_connection_io_error(err: &(dyn std::error::Error + 'static)) -> bool {
    use std::io::ErrorKind;
    let mut current = Some(err);
    while let Some(err) = current {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            if matches!(
                io.kind(),
                ErrorKind::ConnectionRefused
                    | ErrorKind::ConnectionReset
                    | ErrorKind::ConnectionAborted
                    | ErrorKind::NotConnected
                    | ErrorKind::BrokenPipe
                    | ErrorKind::UnexpectedEof
                    | ErrorKind::TimedOut
            ) {
                return true;
            }
        }
        current = err.source();
    }
    false
}

impl fmt::Display for ClassifiedError {
    /// `retryable error (code 242 TABLE_IS_READ_ONLY): <message>`; `unclassified error: <message>`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} error", self.class)?;
        match (self.code, self.code_name()) {
            (Some(code), Some(name)) => write!(f, " (code {code} {name})")?,
            (Some(code), None) => write!(f, " (code {code})")?,
            (None, _) => {}
        }
        write!(f, ": {}", self.message)
    }
}

impl std::error::Error for ClassifiedError {}

/// Logs an unclassified error as a structured warning with `needs_classification = true`, so gaps
/// in the tables surface from real traffic. Does nothing for classified errors.
pub fn log_unknown(err: &ClassifiedError, database: &str, table: &str, endpoint: &str) {
    if err.class != ErrorClass::Unknown {
        return;
    }
    tracing::warn!(
        needs_classification = true,
        database,
        table,
        endpoint,
        code = err.code,
        code_name = err.code_name(),
        error = %err.message,
        "unclassified ClickHouse error; add its code to RETRYABLE_CODES or PERMANENT_CODES in \
         flow-clickhouse/src/server/classify.rs"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_coded_refusal_that_is_not_about_the_target_may_be_a_rows_fault() {
        let coded = |code| ClassifiedError::from_server(Some(code), "x");
        // throwIf, a value out of range, a parse error: the rows.
        for code in [395, 321, 27, 53] {
            assert!(is_row_rejection(&coded(code)), "{code}");
        }
        // No table, no column, no right, a wrong password; or transient; or no code at all.
        for code in [60, 16, 497, 193, 252, 319] {
            assert!(!is_row_rejection(&coded(code)), "{code}");
        }
        assert!(!is_row_rejection(&ClassifiedError::from_server(
            None, "cut"
        )));
    }

    #[test]
    fn a_missing_table_or_database_or_a_read_only_host_is_replica_local_and_nothing_else_is() {
        let coded = |code| ClassifiedError::from_server(Some(code), "x");
        for code in [60, 81, 164, 192, 193, 194, 195, 291, 516] {
            assert!(is_replica_local(&coded(code)), "{code}");
        }
        // The rows (395, 53), the table's columns (16), a transient read-only replica (242,
        // retried anyway), an unclassified code, or no code at all (the columns guard).
        for code in [395, 53, 16, 242, 319, 62] {
            assert!(!is_replica_local(&coded(code)), "{code}");
        }
        assert!(!is_replica_local(&ClassifiedError {
            class: ErrorClass::Permanent,
            code: None,
            message: "the table's columns changed".into()
        }));
        // Every replica-local code is a permanent one.
        for code in REPLICA_LOCAL_CODES {
            assert_eq!(classify_code(*code), ErrorClass::Permanent, "{code}");
        }
    }

    #[test]
    fn only_a_refusal_while_reading_the_body_proves_nothing_was_stored() {
        let coded = |code| ClassifiedError::from_server(Some(code), "x");
        // Cut short or malformed for the planned types: refused before the block was written.
        for code in [33, 32, 27, 6, 72] {
            assert!(refused_unread(&coded(code)), "{code}");
        }
        // Unknown outcomes (the part may be in the table), the rows' values, no code at all.
        for code in [319, 999, 1000, 395, 53, 242] {
            assert!(!refused_unread(&coded(code)), "{code}");
        }
        assert!(!refused_unread(&ClassifiedError::network(
            "connection reset"
        )));
    }

    #[test]
    fn a_block_commit_the_server_rolled_back_stored_nothing_but_another_zookeeper_error_may_have() {
        let widened_under_the_insert = ClassifiedError::from_server(
            Some(244),
            "Code: 244, e.displayText() = DB::Exception: Unexpected logical error while adding \
             block 6 with ID 'all_5993827626240998575_272352490515655788': Bad version, path \
             /clickhouse/tables/a/default.t/columns, e.what() = DB::Exception",
        );
        assert!(refused_unstored(&widened_under_the_insert));
        assert!(!refused_unread(&widened_under_the_insert));
        // The same code elsewhere (not a block's commit), and an unknown commit outcome.
        let elsewhere = ClassifiedError::from_server(
            Some(244),
            "Code: 244, e.displayText() = DB::Exception: Unexpected error",
        );
        let unknown = ClassifiedError::from_server(
            Some(319),
            "Unknown status, client must retry. Reason: Connection loss while adding block",
        );
        assert!(!refused_unstored(&elsewhere));
        assert!(!refused_unstored(&unknown));
        // Every refusal while reading the body is one.
        for code in UNREAD_BODY_CODES {
            assert!(refused_unstored(&ClassifiedError::from_server(
                Some(*code),
                "x"
            )));
        }
    }

    /// The tables of the reference document, verbatim.
    const REFERENCE_RETRYABLE: [u32; 24] = [
        159, 198, 201, 202, 203, 209, 210, 236, 241, 242, 243, 244, 254, 265, 279, 285, 286, 289,
        290, 297, 364, 384, 999, 1000,
    ];
    const REFERENCE_PERMANENT: [u32; 29] = [
        6, 7, 16, 18, 20, 25, 26, 27, 38, 41, 43, 44, 47, 53, 60, 72, 80, 81, 117, 164, 192, 193,
        194, 195, 291, 321, 349, 392, 516,
    ];

    #[test]
    fn every_reference_retryable_code_is_retryable() {
        for code in REFERENCE_RETRYABLE {
            assert_eq!(classify_code(code), ErrorClass::Retryable, "{code}");
            assert!(code_name(code).is_some(), "{code}");
        }
    }

    #[test]
    fn every_reference_permanent_code_is_permanent() {
        for code in REFERENCE_PERMANENT {
            assert_eq!(classify_code(code), ErrorClass::Permanent, "{code}");
            assert!(code_name(code).is_some(), "{code}");
        }
    }

    #[test]
    fn tables_are_exactly_the_reference_plus_additions_and_disjoint() {
        let mut retryable: Vec<u32> = RETRYABLE_CODES.iter().map(|(c, _)| *c).collect();
        retryable.sort_unstable();
        let mut expected: Vec<u32> = REFERENCE_RETRYABLE
            .into_iter()
            .chain([75, 216, 225, 252, 319])
            .collect();
        expected.sort_unstable();
        assert_eq!(retryable, expected);
        let mut permanent: Vec<u32> = PERMANENT_CODES.iter().map(|(c, _)| *c).collect();
        permanent.sort_unstable();
        let mut expected: Vec<u32> = REFERENCE_PERMANENT.into_iter().chain([190, 395]).collect();
        expected.sort_unstable();
        assert_eq!(permanent, expected);
        for code in &retryable {
            assert!(!permanent.contains(code), "{code} is in both tables");
        }
        for (code, _) in OTHER_NAMED_CODES {
            assert_eq!(classify_code(*code), ErrorClass::Unknown, "{code}");
        }
    }

    #[test]
    fn code_names_match_the_reference() {
        assert_eq!(code_name(242), Some("TABLE_IS_READ_ONLY"));
        assert_eq!(code_name(60), Some("UNKNOWN_TABLE"));
        assert_eq!(code_name(516), Some("AUTHENTICATION_FAILED"));
        assert_eq!(code_name(1000), Some("POCO_EXCEPTION"));
        assert_eq!(code_name(62), Some("SYNTAX_ERROR"));
        assert_eq!(code_name(123_456), None);
    }

    #[test]
    fn our_additions_to_the_reference_retryable_table_are_retryable() {
        for (code, name) in [
            (75, "CANNOT_WRITE_TO_FILE_DESCRIPTOR"),
            (225, "NO_ZOOKEEPER"),
            (252, "TOO_MANY_PARTS"),
            (319, "UNKNOWN_STATUS_OF_INSERT"),
        ] {
            assert_eq!(classify_code(code), ErrorClass::Retryable, "{code}");
            assert_eq!(code_name(code), Some(name));
        }
    }

    #[test]
    fn codes_outside_the_tables_are_unknown() {
        for code in [0, 1, 62, 115, 253, 999_999] {
            assert_eq!(classify_code(code), ErrorClass::Unknown, "{code}");
        }
    }

    #[test]
    fn parse_code_reads_18_16_bodies() {
        assert_eq!(
            parse_code(
                None,
                "Code: 242, e.displayText() = DB::Exception: Table is in readonly mode, e.what() \
                 = DB::Exception"
            ),
            Some(242)
        );
        assert_eq!(
            parse_code(
                None,
                "Code: 60, e.displayText() = DB::Exception: Table default.x doesn't exist., \
                 e.what() = DB::Exception\n"
            ),
            Some(60)
        );
    }

    #[test]
    fn parse_code_reads_modern_bodies() {
        assert_eq!(
            parse_code(
                None,
                "Code: 60. DB::Exception: Table default.x does not exist. (UNKNOWN_TABLE) \
                 (version 24.3.1.1)"
            ),
            Some(60)
        );
        assert_eq!(
            parse_code(
                None,
                "Code: 210. DB::NetException: I/O error: Broken pipe, while writing to socket \
                 (127.0.0.1:9000 -> 127.0.0.1:54646). (NETWORK_ERROR) (version 23.8.8.20 \
                 (official build))"
            ),
            Some(210)
        );
    }

    #[test]
    fn parse_code_takes_the_outer_code_of_nested_exceptions() {
        let body = "Code: 279. DB::NetException: All connection tries failed. Log: \n\nCode: 210. \
                    DB::NetException: Connection refused (127.0.0.1:9000). (NETWORK_ERROR)\n";
        assert_eq!(parse_code(None, body), Some(279));
    }

    #[test]
    fn parse_code_prefers_the_header() {
        assert_eq!(
            parse_code(Some("242"), "Code: 60. DB::Exception: x"),
            Some(242)
        );
        assert_eq!(parse_code(Some(" 81 "), ""), Some(81));
        // A garbled header falls back to the body.
        assert_eq!(
            parse_code(Some("abc"), "Code: 60. DB::Exception: x"),
            Some(60)
        );
    }

    #[test]
    fn parse_code_reads_the_crates_header_fallback_text() {
        // `clickhouse` 0.15 turns an empty error body into `Code: <header value>`.
        assert_eq!(parse_code(None, "Code: 242"), Some(242));
    }

    #[test]
    fn parse_code_finds_nothing_without_a_code() {
        assert_eq!(parse_code(None, ""), None);
        assert_eq!(parse_code(None, "503 Service Unavailable"), None);
        assert_eq!(parse_code(None, "Code: abc"), None);
        assert_eq!(parse_code(None, "ErrorCode: 5"), None);
        assert_eq!(parse_code(None, "ErrorCode: 5; Code: 7"), Some(7));
    }

    #[test]
    fn from_server_classifies_by_code_and_unknown_without_one() {
        let err = ClassifiedError::from_server(Some(242), "readonly");
        assert_eq!(err.class, ErrorClass::Retryable);
        assert_eq!(err.code, Some(242));
        assert_eq!(
            ClassifiedError::from_server(Some(60), "x").class,
            ErrorClass::Permanent
        );
        assert_eq!(
            ClassifiedError::from_server(Some(62), "x").class,
            ErrorClass::Unknown
        );
        assert_eq!(
            ClassifiedError::from_server(None, "x").class,
            ErrorClass::Unknown
        );
        let net = ClassifiedError::network("connection refused");
        assert_eq!((net.class, net.code), (ErrorClass::Retryable, None));
    }

    #[test]
    fn from_clickhouse_maps_every_kind_of_error() {
        let body =
            "Code: 242, e.displayText() = DB::Exception: Table is in readonly mode, e.what() \
                    = DB::Exception";
        let err =
            ClassifiedError::from_clickhouse(&clickhouse::error::Error::BadResponse(body.into()));
        assert_eq!(
            err,
            ClassifiedError {
                class: ErrorClass::Retryable,
                code: Some(242),
                message: body.into()
            }
        );
        let err = ClassifiedError::from_clickhouse(&clickhouse::error::Error::BadResponse(
            "Code: 60. DB::Exception: Table default.x does not exist. (UNKNOWN_TABLE) (version \
             24.3.1.1)"
                .into(),
        ));
        assert_eq!((err.class, err.code), (ErrorClass::Permanent, Some(60)));
        let err = ClassifiedError::from_clickhouse(&clickhouse::error::Error::BadResponse(
            "502 Bad Gateway".into(),
        ));
        assert_eq!((err.class, err.code), (ErrorClass::Unknown, None));

        let refused = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        let err =
            ClassifiedError::from_clickhouse(&clickhouse::error::Error::Network(Box::new(refused)));
        assert_eq!((err.class, err.code), (ErrorClass::Retryable, None));
        assert!(
            err.message.starts_with("network error: refused"),
            "{}",
            err.message
        );
        let err = ClassifiedError::from_clickhouse(&clickhouse::error::Error::TimedOut);
        assert_eq!(err.class, ErrorClass::Retryable);
        let reset = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset");
        let err =
            ClassifiedError::from_clickhouse(&clickhouse::error::Error::Other(Box::new(reset)));
        assert_eq!(err.class, ErrorClass::Retryable);

        let other = std::io::Error::other("strange");
        for err in [
            clickhouse::error::Error::Compression(Box::new(std::io::Error::other("lz4"))),
            clickhouse::error::Error::Decompression(Box::new(std::io::Error::other("lz4"))),
            clickhouse::error::Error::Other(Box::new(other)),
            clickhouse::error::Error::NotEnoughData,
            clickhouse::error::Error::SchemaMismatch("column x".into()),
        ] {
            let classified = ClassifiedError::from_clickhouse(&err);
            assert_eq!(classified.class, ErrorClass::Unknown, "{err}");
            assert_eq!(classified.code, None);
            assert_eq!(classified.message, err.to_string());
        }
    }

    #[test]
    fn display_names_class_code_and_name() {
        assert_eq!(
            ClassifiedError::from_server(Some(242), "Table is in readonly mode").to_string(),
            "retryable error (code 242 TABLE_IS_READ_ONLY): Table is in readonly mode"
        );
        assert_eq!(
            ClassifiedError::from_server(Some(60), "no table").to_string(),
            "permanent error (code 60 UNKNOWN_TABLE): no table"
        );
        assert_eq!(
            ClassifiedError::from_server(Some(4242), "odd").to_string(),
            "unclassified error (code 4242): odd"
        );
        assert_eq!(
            ClassifiedError::network("connection refused").to_string(),
            "retryable error: connection refused"
        );
    }

    /// What [`log_unknown`] writes for `err`, through a plain-text subscriber.
    fn logged(err: &ClassifiedError) -> String {
        #[derive(Clone, Default)]
        struct Buffer(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);
        impl std::io::Write for Buffer {
            fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(bytes);
                Ok(bytes.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let buffer = Buffer::default();
        let writer = buffer.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .without_time()
            .with_target(false)
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            log_unknown(err, "default", "events", "127.0.0.1:18123")
        });
        let bytes = buffer.0.lock().unwrap().clone();
        String::from_utf8(bytes).unwrap()
    }

    #[test]
    fn log_unknown_logs_an_unclassified_error_with_its_fields_and_nothing_else() {
        assert_eq!(
            logged(&ClassifiedError::from_server(Some(62), "Syntax error")),
            " WARN unclassified ClickHouse error; add its code to RETRYABLE_CODES or \
             PERMANENT_CODES in flow-clickhouse/src/server/classify.rs needs_classification=true \
             database=\"default\" table=\"events\" endpoint=\"127.0.0.1:18123\" code=62 \
             code_name=\"SYNTAX_ERROR\" error=Syntax error\n"
        );
        // A classified error is not logged.
        assert_eq!(logged(&ClassifiedError::network("refused")), "");
    }
}
