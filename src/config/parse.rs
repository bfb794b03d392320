use super::Config;
use std::path::Path;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub key: String,
    pub line: Option<usize>,
    pub message: String,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{} problem(s) in {file}", problems.len())]
    Invalid {
        file: String,
        problems: Vec<Problem>,
    },
}

pub fn load(path: &Path) -> Result<Config, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.display().to_string(),
        source,
    })?;
    parse_str(&text, path)
}

pub fn parse_str(_text: &str, path: &Path) -> Result<Config, ConfigError> {
    Err(ConfigError::Invalid {
        file: path.display().to_string(),
        problems: vec![],
    })
}
