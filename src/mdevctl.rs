//! mdevctl's JSON shapes, for `define --jsonfile`, `start --jsonfile`, `modify --jsonfile`
//! and `list --dumpjson`.
//!
//! A device's config is mdevctl's file format: `{"mdev_type": TYPE, "start": "auto"|"manual",
//! "attrs": [{KEY: VALUE}, ...]}`, each attribute an object of one key (umdev's `--opt
//! KEY=VALUE`); umdev adds `"pin_mode"` when one is set. A listing is mdevctl's too: an array
//! holding one object that maps the parent's name (umdev has one parent, `umdev`) to an array
//! of `{UUID: config}`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use umdev_mdev::types::{InstanceOptions, PinModeName};
use uuid::Uuid;

use crate::lifecycle::{Definition, StartPolicy};

/// The one parent device umdev's types hang off, as `-p` and the JSON name it.
pub const PARENT: &str = "umdev";

/// A device's config in mdevctl's format.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceConfig {
    /// The type.
    pub mdev_type: String,
    /// When it starts.
    #[serde(default = "manual")]
    pub start: StartPolicy,
    /// The options, one `{KEY: VALUE}` object each, in order.
    #[serde(default)]
    pub attrs: Vec<BTreeMap<String, serde_json::Value>>,
    /// How the instance pins guest pages (umdev's; mdevctl has no such field).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pin_mode: Option<PinModeName>,
}

fn manual() -> StartPolicy {
    StartPolicy::Manual
}

impl DeviceConfig {
    /// Reads a config from JSON text.
    pub fn parse(text: &str) -> Result<DeviceConfig, String> {
        serde_json::from_str(text).map_err(|e| format!("not an mdevctl device config: {e}"))
    }

    /// A definition's config.
    pub fn of(mdev_type: &str, start: StartPolicy, options: &InstanceOptions) -> DeviceConfig {
        DeviceConfig {
            mdev_type: mdev_type.to_string(),
            start,
            attrs: options
                .params
                .iter()
                .map(|(k, v)| BTreeMap::from([(k.clone(), v.clone().into())]))
                .collect(),
            pin_mode: options.pin_mode,
        }
    }

    /// The options its attributes and pin mode say. Each attribute is one key with a string
    /// (or number, or boolean) value; a key given twice is refused.
    pub fn options(&self) -> Result<InstanceOptions, String> {
        let mut options = InstanceOptions { pin_mode: self.pin_mode, params: BTreeMap::new() };
        for (i, attr) in self.attrs.iter().enumerate() {
            let mut pairs = attr.iter();
            let (Some((key, value)), None) = (pairs.next(), pairs.next()) else {
                return Err(format!(
                    "attrs[{i}]: an attribute is an object of one key, {{\"KEY\": \"VALUE\"}}"
                ));
            };
            let value = match value {
                serde_json::Value::String(s) => s.clone(),
                serde_json::Value::Number(n) => n.to_string(),
                serde_json::Value::Bool(b) => b.to_string(),
                other => return Err(format!("attrs[{i}]: {key}: {other} is not a string")),
            };
            if options.params.insert(key.clone(), value).is_some() {
                return Err(format!("attrs[{i}]: {key} is given twice"));
            }
        }
        Ok(options)
    }
}

impl From<&Definition> for DeviceConfig {
    fn from(def: &Definition) -> Self {
        DeviceConfig::of(&def.mdev_type, def.start, &def.options)
    }
}

/// mdevctl's listing: `[{"umdev": [{UUID: config}, ...]}]`, or `[]` for no device.
pub fn listing(devices: &[(Uuid, DeviceConfig)]) -> serde_json::Value {
    if devices.is_empty() {
        return serde_json::Value::Array(Vec::new());
    }
    let entries: Vec<serde_json::Value> =
        devices.iter().map(|(uuid, config)| serde_json::json!({ uuid.to_string(): config })).collect();
    serde_json::json!([{ PARENT: entries }])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configs_round_trip_and_refuse_what_is_ambiguous() {
        let text = r#"{"mdev_type": "nvme", "start": "auto",
                       "attrs": [{"ns1": "ram:1G"}, {"queues": 2}], "pin_mode": "lock"}"#;
        let config = DeviceConfig::parse(text).unwrap();
        let options = config.options().unwrap();
        assert_eq!(options.params["queues"], "2");
        assert_eq!(options.pin_mode, Some(PinModeName::Lock));
        assert_eq!(DeviceConfig::of("nvme", StartPolicy::Auto, &options).options().unwrap(), options);
        let bare = DeviceConfig::parse(r#"{"mdev_type": "testdev"}"#).unwrap();
        assert_eq!((bare.start, bare.options().unwrap()), (StartPolicy::Manual, InstanceOptions::default()));
        let twice = DeviceConfig::parse(r#"{"mdev_type": "x", "attrs": [{"a": "1"}, {"a": "2"}]}"#).unwrap();
        assert!(twice.options().unwrap_err().contains("given twice"));
        let two_keys = DeviceConfig::parse(r#"{"mdev_type": "x", "attrs": [{"a": "1", "b": "2"}]}"#).unwrap();
        assert!(two_keys.options().is_err());
        assert!(DeviceConfig::parse(r#"{"mdev_type": "x", "strat": "auto"}"#).is_err(), "a typo is refused");
        assert_eq!(listing(&[]), serde_json::json!([]));
        let uuid = Uuid::from_u128(1);
        let listed = listing(&[(uuid, bare)]);
        assert_eq!(listed[0]["umdev"][0][uuid.to_string()]["mdev_type"], "testdev");
    }
}
