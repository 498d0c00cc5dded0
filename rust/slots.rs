//! Index-addressed storage that reuses freed slots: the pattern of the engine's jobs, the KV
//! pool's sequences and runs, the baselines' holder lists and the caches' runs, written once.

/// Put `item` in a freed slot of `items` (the last freed first), else at the end; its index.
#[inline]
pub fn put<T>(items: &mut Vec<T>, free: &mut Vec<u32>, item: T) -> u32 {
    match free.pop() {
        Some(i) => {
            items[i as usize] = item;
            i
        }
        None => {
            items.push(item);
            (items.len() - 1) as u32
        }
    }
}

#[cfg(test)]
mod tests {
    use super::put;

    #[test]
    fn a_freed_slot_is_reused_before_the_vec_grows() {
        let (mut items, mut free) = (Vec::new(), Vec::new());
        assert_eq!((put(&mut items, &mut free, 'a'), put(&mut items, &mut free, 'b')), (0, 1));
        free.push(0);
        assert_eq!(put(&mut items, &mut free, 'c'), 0);
        assert_eq!((items, put(&mut Vec::new(), &mut free, 'd')), (vec!['c', 'b'], 0));
    }
}
