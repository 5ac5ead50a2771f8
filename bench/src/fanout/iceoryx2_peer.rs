//! The iceoryx2 row of `rds-bench fanout`: publish-subscribe (the crate, zero-copy shared
//! memory, no daemon) with one subscriber per member thread. iceoryx2's subscribers have no
//! blocking receive, so each member also holds a listener of an event service that the sender
//! notifies after each publish: one publish plus one notify per message, the blocking use
//! iceoryx2 documents. The publisher retries while a subscriber's buffer is full, so nothing
//! is dropped (the window keeps it from happening anyway).

use super::{run, FanoutArgs, FanoutResult, Impl};
use anyhow::{anyhow, bail, Context, Result};
use iceoryx2::port::backpressure_strategy::BackpressureStrategy;
use iceoryx2::prelude::*;
use std::time::{Duration, Instant};

fn err<E: std::fmt::Debug>(what: &'static str) -> impl FnOnce(E) -> anyhow::Error {
    move |e| anyhow!("iceoryx2 {what}: {e:?}")
}

pub fn run_iceoryx2(a: &FanoutArgs, n: usize, run_no: u16) -> Result<FanoutResult> {
    // Its default config (no iceoryx2.toml) is what we want: no warning about it.
    set_log_level_from_env_or(LogLevel::Error);
    let base = format!("rds-bench/fanout/{}/{run_no}", std::process::id());
    let data_name = format!("{base}/data");
    let wake_name = format!("{base}/wake");
    let node = NodeBuilder::new()
        .create::<ipc::Service>()
        .map_err(err("node"))?;
    let data = node
        .service_builder(&data_name.as_str().try_into().map_err(err("name"))?)
        .publish_subscribe::<[u8]>()
        .max_subscribers(n)
        .max_publishers(1)
        .max_nodes(n + 1)
        .history_size(0)
        .subscriber_max_buffer_size(a.window as usize + 1)
        .enable_safe_overflow(false)
        .create()
        .map_err(err("publish-subscribe service"))?;
    let wake = node
        .service_builder(&wake_name.as_str().try_into().map_err(err("name"))?)
        .event()
        .max_listeners(n)
        .max_notifiers(1)
        .max_nodes(n + 1)
        .create()
        .map_err(err("event service"))?;
    let publisher = data
        .publisher_builder()
        .initial_max_slice_len(a.size)
        .backpressure_strategy(BackpressureStrategy::RetryUntilDelivered)
        .create()
        .map_err(err("publisher"))?;
    let notifier = wake.notifier_builder().create().map_err(err("notifier"))?;
    let makers: Vec<_> = (0..n)
        .map(|_| {
            let (data_name, wake_name) = (data_name.clone(), wake_name.clone());
            // Ports of the ipc service stay on the thread that made them: each member opens
            // the services with a node of its own, as another process would.
            move || -> Result<_> {
                let node = NodeBuilder::new()
                    .create::<ipc::Service>()
                    .map_err(err("member node"))?;
                let data = node
                    .service_builder(&data_name.as_str().try_into().map_err(err("name"))?)
                    .publish_subscribe::<[u8]>()
                    .open()
                    .map_err(err("open publish-subscribe service"))?;
                let wake = node
                    .service_builder(&wake_name.as_str().try_into().map_err(err("name"))?)
                    .event()
                    .open()
                    .map_err(err("open event service"))?;
                let sub = data
                    .subscriber_builder()
                    .create()
                    .map_err(err("subscriber"))?;
                let listener = wake.listener_builder().create().map_err(err("listener"))?;
                Ok(move |buf: &mut [u8]| -> Result<usize> {
                    let _keep = (&node, &data, &wake);
                    let start = Instant::now();
                    loop {
                        if let Some(sample) = sub.receive().map_err(err("receive"))? {
                            let p = sample.payload();
                            if p.len() > buf.len() {
                                bail!("iceoryx2 sample of {} bytes", p.len());
                            }
                            buf[..p.len()].copy_from_slice(p);
                            return Ok(p.len());
                        }
                        // It may return with no event (a wake-up whose event an earlier wait
                        // already collected): only the clock says it timed out.
                        listener
                            .timed_wait(|_| {}, Duration::from_secs(1))
                            .map_err(err("listener wait"))?;
                        if start.elapsed() > Duration::from_secs(10) {
                            bail!("iceoryx2: nothing for 10 s");
                        }
                    }
                })
            }
        })
        .collect();
    run(a, Impl::Iceoryx2, makers, |msg| {
        let sample = publisher
            .loan_slice_uninit(msg.len())
            .map_err(err("loan"))?;
        let reached = sample
            .write_from_slice(msg)
            .send()
            .map_err(err("send"))
            .context("publish")?;
        if reached != n {
            bail!("iceoryx2 publish reached {reached} of {n} subscribers");
        }
        notifier.notify().map_err(err("notify"))?;
        Ok(())
    })
}
