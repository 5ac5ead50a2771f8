use rdsd_tests::*;

#[test]
fn two_processes_exchange_in_order() {
    let d = Daemon::start(&[]);
    let mut r = d.app(&["recv", "127.0.0.1:5000", "1000"]);
    assert_eq!(r.expect("bound"), "5000");
    let s = d.app(&["send", "127.0.0.1:5001", "127.0.0.1:5000", "1000", "64"]);
    assert_eq!(s.wait(), 0);
    assert_eq!(r.expect("received"), "1000");
    assert_eq!(r.wait(), 0);
    assert_eq!(d.stat("loop_delivered"), 1000);
}
