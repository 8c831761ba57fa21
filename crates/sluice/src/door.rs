//! The flags of an admin listener's door, shared by `sluice serve` and `sluice pace`
//! (SPEC S2, S3): the names `Host` may carry, and the token.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Args;
use sluice_door::{AdminToken, DoorConfig, TOKEN_ENV};

use crate::BadInput;

/// Who the admin listener lets in.
#[derive(Debug, Clone, Args)]
pub struct DoorArgs {
    /// A name the admin listener answers to besides `localhost` and its own
    /// addresses (e.g. the name a reverse proxy forwards as `Host`); repeat for more.
    /// Any other `Host` is answered 421, so a web page that rebinds its name to this
    /// machine cannot read the admin pages.
    #[arg(long = "admin-host", value_name = "NAME")]
    pub admin_hosts: Vec<String>,

    /// File holding the admin token (one line; not readable by every user). With a
    /// token every admin request needs `Authorization: Bearer <token>` (the pages ask
    /// for it once and keep it in an HttpOnly cookie). Required when the admin
    /// address is not loopback; SLUICE_ADMIN_TOKEN may hold the token instead.
    #[arg(long, value_name = "FILE")]
    pub admin_token_file: Option<PathBuf>,
}

impl DoorArgs {
    /// The door of an admin listener on `admin`, with `open` paths served without the
    /// token.
    ///
    /// # Errors
    /// [`BadInput`] for a token file that is missing, empty or readable by every user,
    /// and for an admin address beyond loopback with no token, naming the flag.
    pub fn door(&self, admin: SocketAddr, open: Vec<String>) -> Result<DoorConfig, BadInput> {
        let token = match &self.admin_token_file {
            Some(path) => Some(
                AdminToken::from_file(path)
                    .map_err(|e| BadInput(format!("--admin-token-file: {e}")))?,
            ),
            None => AdminToken::from_env().map_err(|e| BadInput(e.to_string()))?,
        };
        if token.is_none() && sluice_door::needs_token(admin) {
            return Err(BadInput(format!(
                "--admin {admin} is reachable beyond loopback: give it a token with \
                 --admin-token-file FILE (or {TOKEN_ENV}), or bind it to 127.0.0.1"
            )));
        }
        for name in &self.admin_hosts {
            if name.is_empty() || name.contains(['/', ':', '@', ' ']) {
                return Err(BadInput(format!(
                    "--admin-host {name:?}: expected a host name such as admin.example.com"
                )));
            }
        }
        Ok(DoorConfig {
            hosts: self.admin_hosts.clone(),
            token,
            open_paths: open,
        })
    }
}
