//! A bounded `text/event-stream` reader: the `data` of each event.
//!
//! Why not a crate: the SSE parsers at hand grow their buffers with the
//! stream; a server that never ends an event would grow the executor's
//! memory. This one refuses a line or event over `max` bytes. MCP uses
//! only `data` (and `id`/`retry`, which a one-shot POST stream does not
//! need), so the parser reads `data` lines and ignores the other fields.

pub struct SseReader {
    line: Vec<u8>,
    data: Vec<u8>,
    max: usize,
    has_data: bool,
}

#[derive(Debug, PartialEq, Eq)]
pub struct TooLarge;

impl SseReader {
    pub fn new(max: usize) -> Self {
        SseReader {
            line: Vec::new(),
            data: Vec::new(),
            max,
            has_data: false,
        }
    }

    /// Feed bytes; the events they complete.
    pub fn feed(&mut self, chunk: &[u8]) -> Result<Vec<String>, TooLarge> {
        let mut events = Vec::new();
        for &b in chunk {
            if b != b'\n' {
                if self.line.len() >= self.max {
                    return Err(TooLarge);
                }
                self.line.push(b);
                continue;
            }
            if self.line.last() == Some(&b'\r') {
                self.line.pop();
            }
            if self.line.is_empty() {
                if self.has_data {
                    events.push(String::from_utf8_lossy(&self.data).into_owned());
                }
                self.data.clear();
                self.has_data = false;
            } else if let Some(rest) = self.line.strip_prefix(b"data:") {
                let rest = rest.strip_prefix(b" ").unwrap_or(rest);
                if self.data.len() + rest.len() + 1 > self.max {
                    return Err(TooLarge);
                }
                if self.has_data {
                    self.data.push(b'\n');
                }
                self.data.extend_from_slice(rest);
                self.has_data = true;
            }
            self.line.clear();
        }
        Ok(events)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_split_anywhere() {
        let stream =
            b": comment\nevent: message\ndata: {\"a\":\ndata: 1}\r\n\r\nid: 4\ndata:{}\n\n";
        for cut in 0..stream.len() {
            let mut r = SseReader::new(1024);
            let mut got = r.feed(&stream[..cut]).unwrap();
            got.extend(r.feed(&stream[cut..]).unwrap());
            assert_eq!(got, vec!["{\"a\":\n1}".to_owned(), "{}".to_owned()]);
        }
    }

    #[test]
    fn a_line_or_event_over_the_limit_is_refused() {
        assert_eq!(SseReader::new(8).feed(&[b'x'; 9]), Err(TooLarge));
        let mut r = SseReader::new(10);
        r.feed(b"data:12345\n").unwrap();
        assert_eq!(r.feed(b"data:12345\n"), Err(TooLarge));
    }
}
