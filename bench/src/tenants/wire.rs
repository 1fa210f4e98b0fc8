//! A plain protocol-3 client for the `tenants` scenario's fleet run: whole frames
//! through `ipc-protocol`'s codec, one request at a time. Its speed is not measured
//! (the `cost` part uses the pre-encoded frames of `load.rs`), so it can be simple.

use std::path::Path;

use ipc_protocol::{ClientFrame, Reply, Request};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

use crate::frames::Reader;

/// One connection to a sidecar, `Hello` done (protocol 3).
pub struct Client {
    /// The socket.
    stream: UnixStream,
    /// Replies read so far, split into frames.
    reader: Reader,
    /// The last request id used.
    id: u64,
}

impl Client {
    pub async fn connect(path: &Path) -> Result<Client, String> {
        let stream = UnixStream::connect(path)
            .await
            .map_err(|e| format!("connect {}: {e}", path.display()))?;
        let mut c = Client {
            stream,
            reader: Reader::default(),
            id: 0,
        };
        let hello = Request::Hello {
            protocol_version: 3,
            client_name: "polygate-bench/tenants".into(),
            pid: std::process::id(),
        };
        match c.ask(hello).await? {
            Reply::Welcome { .. } => Ok(c),
            other => Err(format!("Hello answered {other:?}")),
        }
    }

    /// Send `request` without reading its reply.
    pub async fn send(&mut self, request: Request) -> Result<u64, String> {
        self.id += 1;
        let payload = ipc_protocol::encode_client(&ClientFrame {
            id: self.id,
            request,
        })
        .map_err(|e| e.to_string())?;
        let mut bytes = (payload.len() as u32).to_be_bytes().to_vec();
        bytes.extend_from_slice(&payload);
        self.stream
            .write_all(&bytes)
            .await
            .map_err(|e| e.to_string())?;
        Ok(self.id)
    }

    /// Send `request` and read its reply.
    pub async fn ask(&mut self, request: Request) -> Result<Reply, String> {
        let id = self.send(request).await?;
        loop {
            if let Some(f) = self.reader.next() {
                let frame = ipc_protocol::decode_server(f.payload).map_err(|e| e.to_string())?;
                if frame.id != id {
                    return Err(format!("reply to {}, asked {id}", frame.id));
                }
                return Ok(frame.reply);
            }
            let n = self
                .stream
                .read_buf(self.reader.spare())
                .await
                .map_err(|e| e.to_string())?;
            if n == 0 {
                return Err("the sidecar closed the connection".into());
            }
        }
    }
}
