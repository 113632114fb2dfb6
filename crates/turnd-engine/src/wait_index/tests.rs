use super::*;

fn entry(state: WaitState, since_ms: u64, f: &str) -> Option<WaitEntry<'_>> {
    Some(WaitEntry {
        state,
        since_ms,
        function_id: f,
        deadline_ms: None,
        stale_at_ms: None,
        inflight: state == WaitState::AwaitingResult,
    })
}

fn query<'a>(served: &'a HashSet<String>, order: SessionOrder, limit: usize) -> Query<'a> {
    Query {
        state: None,
        function_id: None,
        stuck: false,
        order,
        limit,
        cursor: None,
        now: 1_000,
        served,
    }
}

#[test]
fn entries_move_between_lists_and_leave() {
    let served = HashSet::new();
    let mut ix = WaitIndex::default();
    ix.set(&Arc::from("s1"), entry(WaitState::AwaitingWorker, 30, "f"));
    ix.set(&Arc::from("s2"), entry(WaitState::AwaitingResult, 10, "g"));
    ix.set(&Arc::from("s3"), entry(WaitState::AwaitingWorker, 20, "f"));
    let p = ix.page(&query(&served, SessionOrder::Wait, 10));
    let ids: Vec<&str> = p.ids.iter().map(|i| &**i).collect();
    assert_eq!(ids, ["s2", "s3", "s1"]);
    assert_eq!(p.total, 3);
    assert_eq!(
        ix.overview(),
        Overview {
            active: 3,
            inflight: 1,
            by_state: [
                (WaitState::AwaitingWorker, 2),
                (WaitState::AwaitingResult, 1)
            ]
            .into(),
            oldest_since_ms: Some(10),
        }
    );
    // s2 moves to another state and function; s1 finishes.
    ix.set(&Arc::from("s2"), entry(WaitState::BackingOff, 40, "f"));
    ix.set(&Arc::from("s1"), None);
    let mut q = query(&served, SessionOrder::Wait, 10);
    q.function_id = Some("f");
    let p = ix.page(&q);
    let ids: Vec<&str> = p.ids.iter().map(|i| &**i).collect();
    assert_eq!(ids, ["s3", "s2"]);
    assert_eq!(p.counts.get("backing_off"), Some(&1));
    assert_eq!(p.counts.get("awaiting_worker"), Some(&1));
    assert!(!ix.by_function.contains_key("g"));
    assert!(!ix.function_counts.contains_key("g"));
    assert_eq!(ix.len(), 2);
    assert_eq!(
        ix.overview(),
        Overview {
            active: 2,
            inflight: 0,
            by_state: [(WaitState::AwaitingWorker, 1), (WaitState::BackingOff, 1)].into(),
            oldest_since_ms: Some(20),
        }
    );
}

/// Every list and count of an index, without the lists left empty.
#[allow(clippy::type_complexity)]
fn contents(
    ix: &WaitIndex,
) -> (
    Vec<(u64, String)>,
    Vec<(String, Vec<(u64, String)>, Vec<String>)>,
    Vec<(String, Vec<(WaitState, u64)>)>,
    Vec<(String, WaitState, u64, String)>,
) {
    let list = |l: &Lists| -> (Vec<(u64, String)>, Vec<String>) {
        (
            l.by_wait.iter().map(|(s, i)| (*s, i.to_string())).collect(),
            l.by_id.iter().map(|i| i.to_string()).collect(),
        )
    };
    let (all, all_ids) = list(&ix.all);
    assert_eq!(all.len(), all_ids.len());
    let mut lists: Vec<(String, Vec<(u64, String)>, Vec<String>)> = Vec::new();
    for (k, l) in &ix.by_state {
        let (w, i) = list(l);
        if !i.is_empty() {
            lists.push((format!("state {}", k.as_str()), w, i));
        }
    }
    for (k, l) in &ix.by_function {
        let (w, i) = list(l);
        lists.push((format!("function {k}"), w, i));
    }
    lists.sort();
    let mut counts: Vec<(String, Vec<(WaitState, u64)>)> = ix
        .function_counts
        .iter()
        .map(|(f, c)| (f.to_string(), c.iter().map(|(s, n)| (*s, *n)).collect()))
        .collect();
    counts.sort();
    let mut entries: Vec<(String, WaitState, u64, String)> = ix
        .entries
        .iter()
        .map(|(i, e)| {
            (
                i.to_string(),
                e.state,
                e.since_ms,
                e.function_id.to_string(),
            )
        })
        .collect();
    entries.sort();
    (all, lists, counts, entries)
}

/// Entries set over and over (new waits, other states, other functions, ends)
/// leave the index as one made from the last entries alone.
#[test]
fn an_index_changed_in_place_equals_one_built_afresh() {
    let functions = ["f", "g", "h"];
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = |n: u64| {
        seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (seed >> 33) % n
    };
    let mut ix = WaitIndex::default();
    let mut last: HashMap<String, (WaitState, u64, &str, bool)> = HashMap::new();
    // Whether the holder has a live invocation, apart from its state, so that
    // a change of that alone is a change too.
    let with =
        |e: Option<WaitEntry<'static>>, inflight: bool| e.map(|e| WaitEntry { inflight, ..e });
    for step in 0..5_000 {
        let sid: Arc<str> = Arc::from(format!("s{}", next(12)));
        if next(6) == 0 {
            ix.set(&sid, None);
            last.remove(&*sid);
        } else {
            let state = WaitState::ALL[next(WaitState::ALL.len() as u64) as usize];
            // Few distinct times, so that some changes keep the time.
            let since = next(4);
            let spread = if next(5) == 0 { 3 } else { 1 };
            let f = functions[next(spread) as usize];
            let inflight = next(2) == 0;
            ix.set(&sid, with(entry(state, since, f), inflight));
            last.insert(sid.to_string(), (state, since, f, inflight));
        }
        let mut fresh = WaitIndex::default();
        for (sid, (state, since, f, inflight)) in &last {
            fresh.set(
                &Arc::from(sid.as_str()),
                with(entry(*state, *since, f), *inflight),
            );
        }
        assert_eq!(contents(&ix), contents(&fresh), "after step {step}");
        assert_eq!(ix.overview(), fresh.overview(), "after step {step}");
    }
}

/// Each page's `previous` is the cursor the page before was read with (`None`
/// for the first page), in both orders and with a filter that skips sessions.
#[test]
fn previous_leads_back_to_the_page_before() {
    let served = HashSet::new();
    let mut ix = WaitIndex::default();
    for i in 0..25u64 {
        let state = if i % 3 == 0 {
            WaitState::BackingOff
        } else {
            WaitState::AwaitingWorker
        };
        ix.set(
            &Arc::from(format!("s{i:02}")),
            entry(state, 100 - i % 5, "f"),
        );
    }
    for (order, state) in [
        (SessionOrder::Wait, None),
        (SessionOrder::Id, None),
        (SessionOrder::Id, Some(WaitState::AwaitingWorker)),
    ] {
        let mut cursors: Vec<Option<Cursor>> = vec![None];
        loop {
            let mut q = query(&served, order, 4);
            q.state = state;
            q.cursor = cursors.last().and_then(|c| c.as_ref());
            let p = ix.page(&q);
            let back = p.previous.clone();
            match cursors.len() {
                1 => assert_eq!(back, None, "{order:?}: the first page"),
                n => assert_eq!(back, Some(cursors[n - 2].clone()), "{order:?} page {n}"),
            }
            match p.next {
                Some(c) => cursors.push(Some(c)),
                None => break,
            }
        }
        assert!(cursors.len() >= 4, "{order:?}: {}", cursors.len());
    }
}

#[test]
fn pages_follow_the_cursor_without_gaps_or_repeats() {
    let served = HashSet::new();
    let mut ix = WaitIndex::default();
    for i in 0..25u64 {
        ix.set(
            &Arc::from(format!("s{i:02}")),
            entry(WaitState::AwaitingWorker, 100 - i % 5, "f"),
        );
    }
    for order in [SessionOrder::Wait, SessionOrder::Id] {
        let mut seen = Vec::new();
        let mut cursor: Option<Cursor> = None;
        loop {
            let mut q = query(&served, order, 7);
            q.cursor = cursor.as_ref();
            let p = ix.page(&q);
            seen.extend(p.ids.iter().map(|i| i.to_string()));
            match p.next {
                Some(c) => {
                    let text = c.encode();
                    cursor = Some(Cursor::decode(&text, order).expect("round trip"));
                }
                None => break,
            }
        }
        let mut sorted = seen.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), 25, "{order:?}: {seen:?}");
        if order == SessionOrder::Id {
            assert_eq!(seen, sorted);
        }
    }
}
